"""HTTP front end of the inference engine (aiohttp): JSON in, JSON or Server-Sent Events out.

    POST /v1/query    {image_url | image, question, reasoning?, spatial_refs?, stream?, settings?, priority?}
    POST /v1/caption  {image_url | image, length?, stream?, settings?, priority?}
    POST /v1/detect   {image_url | image, object, settings?, priority?}
    POST /v1/point    {image_url | image, object, spatial_refs?, settings?, priority?}
    POST /v1/segment  {image_url | image, object, spatial_refs?, settings?, priority?}  (MD3 family)
    GET  /health, GET /v1/models, GET /metrics (Prometheus)

The request shapes follow Moondream's cloud API. Images arrive inline only (a `data:` URL or
bare base64): the server never fetches URLs or opens paths a client names. Every request is
validated on its own; a bad one gets a 4xx with `{"error": {"type", "message"}}` and never
touches the others. The engine runs its own worker thread; this module only awaits it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import dataclasses
import hmac
import json
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kestrel_jax.errors import user_errors
from kestrel_jax.models.image_crops import ImageError
from kestrel_jax.prompts import PromptError
from kestrel_jax.serving.engine import (
    EngineBusy,
    EngineConfig,
    EngineError,
    InferenceEngine,
    Result,
    Stream,
    decode_buckets_up_to,
)
from kestrel_jax.serving.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from kestrel_jax.serving.metrics import ServerMetrics, skill_label
from kestrel_jax.serving.request import RequestRejected
from kestrel_jax.serving.runner import RunnerConfig
from kestrel_jax.serving.skills import SettingsError

log = logging.getLogger(__name__)

DEFAULT_DECODE_BUCKETS = EngineConfig().decode_buckets
# Bodies larger than this are parsed on a thread so that streams of other requests keep flowing.
_PARSE_OFF_LOOP_BYTES = 256 * 1024

_COMMON = frozenset({"image_url", "image", "settings", "priority"})
_FIELDS: dict[str, frozenset[str]] = {
    "query": _COMMON | {"question", "reasoning", "spatial_refs", "stream"},
    "caption": _COMMON | {"length", "stream"},
    "detect": _COMMON | {"object"},
    "point": _COMMON | {"object", "spatial_refs"},
    "segment": _COMMON | {"object", "spatial_refs"},
}


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (see Server.port)
    max_body_bytes: int = 20 * 1024 * 1024
    request_timeout_s: float | None = None  # engine deadline per request; past it -> 504
    shutdown_grace_s: float = 30.0  # how long in-flight requests may finish after SIGINT/SIGTERM
    model_name: str | None = None  # shown by /v1/models; default: the checkpoint config's name
    synthetic: bool = False  # serving the random-weight demo model (reported by /health, /v1/models)
    # With a key, every /v1/ endpoint wants "Authorization: Bearer <key>" (401 otherwise); /health
    # and /metrics stay open for probes and scrapers.
    api_key: str | None = None

    def validate(self) -> ServerConfig:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty (None: no key)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        return self


class RequestError(ValueError):
    """A malformed HTTP request (body, fields, image encoding); becomes a 4xx response."""

    def __init__(self, message: str, type: str = "invalid_request", status: int = 400):
        super().__init__(message)
        self.type = type
        self.status = status


# ---------------------------------------------------------------------------------- parsing
@dataclass(frozen=True)
class SkillCall:
    skill: str
    image: bytes | None
    kwargs: dict[str, Any]  # keyword arguments of the engine's skill method (besides image/stream)
    stream: bool


def parse_body(raw: bytes, skill: str) -> SkillCall:
    """JSON body -> validated engine call. Raises RequestError naming the offending field."""
    if not raw.strip():
        raise RequestError("the request body is empty; send a JSON object", "invalid_json")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}", "invalid_json") from e
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}", "invalid_json")
    allowed = _FIELDS[skill]
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise RequestError(f"unknown field(s) {unknown} for /v1/{skill}; allowed: {sorted(allowed)}")

    def field(name: str, kinds: tuple[type, ...], default: Any = None, required: bool = False) -> Any:
        v = body.get(name)
        if v is None:
            if required:
                raise RequestError(f"missing required field {name!r}")
            return default
        # bool is an int in Python; no field here accepts both, so check it explicitly.
        if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
            want = " or ".join(k.__name__ for k in kinds)
            raise RequestError(f"field {name!r} must be {want}, got {type(v).__name__}")
        return v

    image = decode_image(body.get("image_url"), body.get("image"), required=skill != "query")
    kwargs: dict[str, Any] = {"settings": field("settings", (dict,)), "priority": field("priority", (int,), default=0)}
    if skill == "query":
        kwargs["question"] = field("question", (str,), required=True)
        kwargs["reasoning"] = field("reasoning", (bool,))
        kwargs["spatial_refs"] = tuple(field("spatial_refs", (list,), default=[]))
    elif skill == "caption":
        kwargs["length"] = field("length", (str,), default="normal")
    else:
        kwargs["object"] = field("object", (str,), required=True)
        if skill in ("point", "segment"):
            kwargs["spatial_refs"] = tuple(field("spatial_refs", (list,), default=[]))
    return SkillCall(skill, image, kwargs, bool(field("stream", (bool,), default=False)))


def decode_image(image_url: Any, image: Any, *, required: bool) -> bytes | None:
    """`image_url` (a data URL) or `image` (base64, or a data URL too) -> encoded image bytes."""
    if image_url is not None and image is not None:
        raise RequestError("give either 'image_url' or 'image', not both")
    name, value = ("image_url", image_url) if image_url is not None else ("image", image)
    if value is None:
        if required:
            raise RequestError("missing the image: send 'image_url' as a data URL "
                               "(data:image/jpeg;base64,...) or 'image' as base64")
        return None
    if not isinstance(value, str):
        raise RequestError(f"field {name!r} must be a string, got {type(value).__name__}")
    if value.startswith(("http://", "https://")):
        raise RequestError(f"{name!r}: this server does not fetch remote URLs; send the image inline as a data "
                           "URL (data:image/jpeg;base64,...)", "invalid_image")
    if value.startswith("data:"):
        header, sep, payload = value.partition(",")
        if not sep or not header.endswith(";base64"):
            raise RequestError(f"{name!r}: a data URL must be base64 encoded (data:<mime>;base64,<data>)",
                               "invalid_image")
        value = payload
    elif name == "image_url":
        raise RequestError("'image_url' must be a data URL (data:image/jpeg;base64,...)", "invalid_image")
    data = "".join(value.split())  # line-wrapped base64 is common
    data += "=" * (-len(data) % 4)
    try:
        out = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RequestError(f"{name!r} is not valid base64: {e}", "invalid_image") from e
    if not out:
        raise RequestError(f"{name!r} is empty", "invalid_image")
    return out


# ---------------------------------------------------------------------------------- errors
def classify(exc: BaseException) -> tuple[int, str, str]:
    """Exception -> (HTTP status, error type, client-facing message)."""
    if isinstance(exc, RequestError):
        return exc.status, exc.type, str(exc)
    if isinstance(exc, SettingsError):
        return 400, "invalid_settings", str(exc)
    if isinstance(exc, ImageError):
        return 400, "invalid_image", str(exc)
    if isinstance(exc, PromptError):
        return 400, "invalid_prompt", str(exc)
    if isinstance(exc, RequestRejected):
        return 400, "request_rejected", str(exc)
    if isinstance(exc, EngineBusy):
        return 503, "overloaded", str(exc)
    if isinstance(exc, EngineError):
        return 503, "engine_unavailable", str(exc)
    if isinstance(exc, TimeoutError):
        return 504, "timeout", str(exc) or "the request did not finish in time"
    if isinstance(exc, user_errors()):
        return 400, "invalid_request", str(exc)
    return 500, "internal_error", "internal server error; the server log has the details"


_HTTP_TYPES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


class _EventStream(web.StreamResponse):
    """An SSE response; `outcome`: the status its error maps to when the request failed after the
    stream began (its HTTP status is 200 by then), for the metrics."""

    outcome: int | None = None


RETRY_AFTER_S = 1  # told to clients refused with "overloaded"


def error_response(status: int, type: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
    if type == "overloaded":
        headers = {**(headers or {}), "Retry-After": str(RETRY_AFTER_S)}
    return web.json_response({"error": {"type": type, "message": message}}, status=status, headers=headers)


def _json_default(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.asdict(x)
    return str(x)


def _dumps(x: Any) -> str:
    return json.dumps(x, default=_json_default)


def render(result: Result) -> dict[str, Any]:
    return {**result.output, "finish_reason": result.finish_reason, "metrics": dataclasses.asdict(result.metrics),
            "request_id": str(result.request_id)}


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {_dumps(payload)}\n\n".encode()


# ---------------------------------------------------------------------------------- server
class Server:
    """The aiohttp application around one engine. `start()` binds, `stop()` drains and closes."""

    def __init__(self, engine: InferenceEngine, config: ServerConfig | None = None):
        self.engine = engine
        self.config = (config or ServerConfig()).validate()
        self.app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._middleware])
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_get("/metrics", self._metrics)
        for skill in _FIELDS:
            self.app.router.add_post(f"/v1/{skill}", self._skill_handler(skill))
        self.in_flight = 0
        self.draining = False
        self.metrics = ServerMetrics(self._engine_stats)
        self._runner: web.AppRunner | None = None
        self._port: int | None = None
        self._abandoned: set[asyncio.Task[None]] = set()

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        # Handlers are drained by stop() itself; the runner's timeout only bounds stragglers
        # whose engine future can no longer resolve.
        # handler_cancellation: a client that hangs up cancels its handler, and so its engine
        # request (a stream's is cancelled by `_stream`, a reply's by the engine's future).
        self._runner = web.AppRunner(self.app, access_log=log, shutdown_timeout=5.0, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.config.host, self.config.port).start()
        self._port = int(self._runner.addresses[0][1])
        log.info("serving on http://%s:%d", self.config.host, self.port)

    @property
    def port(self) -> int:
        assert self._port is not None, "start() the server first"
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    async def stop(self, *, grace_s: float | None = None, shutdown_engine: bool = True,
                   force: asyncio.Event | None = None) -> None:
        """Refuse new requests (503), stop listening, let in-flight ones finish for up to
        `grace_s` (or until `force` is set), then shut the engine down (failing what is left)."""
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        self.draining = True
        if self._runner is not None:
            for site in list(self._runner.sites):
                await site.stop()
        deadline = time.monotonic() + grace
        if self.in_flight:
            log.info("draining %d in-flight request(s) for up to %.0fs", self.in_flight, grace)
        while self.in_flight and time.monotonic() < deadline and not (force is not None and force.is_set()):
            await asyncio.sleep(0.05)
        if self.in_flight:
            log.warning("%d request(s) still running at shutdown; they fail with 503", self.in_flight)
        if shutdown_engine:
            await self.engine.shutdown()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        for task in list(self._abandoned):
            task.cancel()

    # -- middleware: draining, in-flight count, error mapping -------------------------------
    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        if not self._authorized(request):
            if request.method == "POST":
                self.metrics.request_ended(skill_label(request.path), 401, 0.0)
            return error_response(401, "unauthorized", "this server wants an API key: send 'Authorization: Bearer "
                                  "<key>'", headers={"WWW-Authenticate": "Bearer"})
        if request.method != "POST":
            return await self._handled(request, handler)
        t0 = time.monotonic()
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)
        status = 500
        try:
            response: web.StreamResponse
            if self.draining:
                response = error_response(503, "shutting_down", "the server is shutting down; retry on another replica")
            else:
                response = await self._handled(request, handler)
            status = response.outcome if isinstance(response, _EventStream) and response.outcome else response.status
            return response
        except asyncio.CancelledError:
            status = 499  # the handler was cancelled (the connection or the server went): no response
            raise
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.set(self.in_flight)
            self.metrics.request_ended(skill_label(request.path), status, time.monotonic() - t0)

    async def _handled(self, request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        """The handler's response, or the error response its exception maps to."""
        try:
            out: web.StreamResponse = await handler(request)
            return out
        except web.HTTPException as e:
            if e.status < 400:
                raise
            kind = _HTTP_TYPES.get(e.status, "http_error")
            message = e.reason if e.status != 413 else self._too_large_message(request.content_length)
            if e.status == 405:
                message = f"{request.method} is not allowed on {request.path}"
            elif e.status == 404:
                message = (f"no endpoint {request.path}; see /v1/query, /v1/caption, /v1/detect, /v1/point, "
                           "/v1/segment")
            return error_response(e.status, kind, message)
        except Exception as e:
            status, kind, message = classify(e)
            if status == 500:
                log.exception("unexpected error in %s %s", request.method, request.path)
            return error_response(status, kind, message)

    def _too_large_message(self, size: int | None) -> str:
        limit = self.config.max_body_bytes
        got = f" ({size} bytes)" if size else ""
        return (f"the request body{got} exceeds the server's limit of {limit} bytes ({limit / 2**20:.1f} MiB); "
                "send a smaller image or start the server with a larger --max-request-mb")

    # -- handlers ----------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        alive = self._engine_alive()
        status = "draining" if self.draining else ("ok" if alive else "unavailable")
        body = {"status": status, "model": self._model_info(), "in_flight": self.in_flight,
                "engine": self.engine.stats if alive else None}
        return web.json_response(body, status=200 if status == "ok" else 503, dumps=_dumps)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_info()]})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    def _skill_handler(self, skill: str) -> Callable[[web.Request], Any]:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self._run_skill(request, skill)

        return handle

    async def _run_skill(self, request: web.Request, skill: str) -> web.StreamResponse:
        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
        raw = await request.read()
        if len(raw) > _PARSE_OFF_LOOP_BYTES:
            call = await asyncio.get_running_loop().run_in_executor(None, parse_body, raw, skill)
        else:
            call = parse_body(raw, skill)
        fn = getattr(self.engine, skill)
        deadline = self.config.request_timeout_s
        if skill in ("query", "caption"):
            out = await fn(call.image, stream=call.stream, deadline_s=deadline, **call.kwargs)
        else:
            out = await fn(call.image, deadline_s=deadline, **call.kwargs)
        if isinstance(out, Stream):
            return await self._stream(request, out, skill)
        self.metrics.result(skill, out.finish_reason, out.metrics)
        return web.json_response(render(out), dumps=_dumps)

    async def _stream(self, request: web.Request, stream: Stream, skill: str) -> web.StreamResponse:
        """SSE: `data: {"chunk": ...}` per text chunk, then `data: {"completed": true, ...}` (or
        `data: {"error": ...}` when the request fails after the stream began)."""
        resp = _EventStream(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        try:
            await resp.prepare(request)
            async for chunk in stream:
                await resp.write(_sse({"chunk": chunk, "completed": False}))
            try:
                result = await stream.result()
                self.metrics.result(skill, result.finish_reason, result.metrics)
                final = {"completed": True, **render(result)}
            except Exception as e:
                status, kind, message = classify(e)
                if status == 500:
                    log.exception("unexpected error in a stream of %s", request.path)
                resp.outcome = status
                final = {"completed": True, "error": {"type": kind, "message": message}}
            await resp.write(_sse(final))
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError) as e:
            # Client gone (or server shutting down): free the engine row instead of decoding
            # for nobody; the stream is drained in the background so nothing is left dangling.
            self._abandon(stream)
            if isinstance(e, asyncio.CancelledError):
                raise
            log.info("client disconnected from a stream of %s", request.path)
        return resp

    def _authorized(self, request: web.Request) -> bool:
        key = self.config.api_key
        if key is None or not request.path.startswith("/v1/"):
            return True
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())

    def _engine_alive(self) -> bool:
        return bool(getattr(self.engine, "healthy", True))

    def _engine_stats(self) -> dict[str, Any] | None:
        """The engine's stats for /metrics, None when it is not serving."""
        if not self._engine_alive():
            return None
        stats = getattr(self.engine, "stats", None)
        return stats if isinstance(stats, dict) else None

    def _model_info(self) -> dict[str, Any]:
        cfg = self.engine.cfg
        skills = [k for k in _FIELDS if k != "segment" or cfg.tokenizer.templates.has_segment]
        return {"id": self.config.model_name or cfg.name, "object": "model", "family": cfg.family,
                "synthetic": self.config.synthetic, "context_length": getattr(self.engine, "max_seq_len", None),
                "skills": skills}

    def _try_cancel(self, stream: Stream) -> bool:
        rid = getattr(stream, "request_id", 0)
        if not rid or not hasattr(self.engine, "cancel"):
            return False
        self.engine.cancel(rid)
        return True

    def _abandon(self, stream: Stream) -> None:
        async def drain() -> None:
            # A submission still in the engine's inbox is not cancellable yet: retry on each chunk.
            cancelled = self._try_cancel(stream)
            with contextlib.suppress(Exception):
                async for _ in stream:
                    cancelled = cancelled or self._try_cancel(stream)
                await stream.result()

        task = asyncio.ensure_future(drain())
        self._abandoned.add(task)
        task.add_done_callback(self._abandoned.discard)


# ---------------------------------------------------------------------------------- running
async def serve(engine: InferenceEngine, config: ServerConfig | None = None, *,
                on_started: Callable[[Server], None] | None = None) -> None:
    """Serve until SIGINT or SIGTERM, then shut down gracefully (the engine included). A second
    signal skips the rest of the grace period."""
    server = Server(engine, config)
    stop, force = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            log.warning("%s again: not waiting for in-flight requests", sig.name)
            force.set()
        else:
            log.info("%s: shutting down (new requests get 503)", sig.name)
            stop.set()

    sigs = (signal.SIGINT, signal.SIGTERM)
    for sig in sigs:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await server.start()
        if on_started is not None:
            on_started(server)
        await stop.wait()
        await server.stop(force=force)
    finally:
        for sig in sigs:
            loop.remove_signal_handler(sig)
    log.info("server stopped")


def engine_config(model: str | None = None, *, dtype: str = "bfloat16", kv_dtype: str = "auto",
                  kv_scales: str | None = None, page_size: int = 64, max_batch_size: int | None = None,
                  prefix_cache: bool = True, compile_cache: str | None = None,
                  max_queued: int | None = EngineConfig.max_queued, num_devices: int = 1) -> EngineConfig:
    """`compile_cache`: the persistent compilation (and lowered-step) cache directory, so that a
    restart loads every step instead of compiling it; None: none. `max_queued`: requests held
    beyond those running before new ones get 503 "overloaded" (None: no limit; per device).
    `num_devices`: one engine worker per device (0: every local device). `kv_scales`: a per-layer
    K/V scales file (kestrel_jax/kv_scales.py) in place of the checkpoint's."""
    if max_queued is not None and max_queued < 0:
        raise ValueError(f"max queued must be >= 0, got {max_queued}")
    buckets = DEFAULT_DECODE_BUCKETS if max_batch_size is None else decode_buckets_up_to(max_batch_size)
    runner = RunnerConfig(page_size=page_size, kv_dtype=kv_dtype, kv_scales=kv_scales,
                          compilation_cache_dir=compile_cache)
    return EngineConfig(model_path=model, dtype=dtype, runner=runner, decode_buckets=buckets,
                        enable_prefix_cache=prefix_cache, max_queued=max_queued, num_devices=num_devices)


def run(engine_cfg: EngineConfig, config: ServerConfig) -> None:
    """Load the engine (compiling every bucket), then serve until SIGINT/SIGTERM."""
    config = config.validate()
    if engine_cfg.model_path is None:
        log.warning("=" * 88)
        log.warning("NO --model GIVEN: serving the synthetic demo model with RANDOM weights; every answer is "
                    "noise. Pass --model PATH to serve a real Moondream checkpoint.")
        log.warning("=" * 88)

    async def main() -> None:
        t0 = time.perf_counter()
        log.info("loading the model and compiling every batch bucket (minutes on a CPU) ...")
        engine = await InferenceEngine.create(engine_cfg)
        log.info("engine ready in %.1fs (%s, %s)", time.perf_counter() - t0, engine.cfg.name, engine.cfg.family)
        await serve(engine, config)

    asyncio.run(main())
