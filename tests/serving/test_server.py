"""The HTTP server over a real (tiny, CPU) engine on a real socket: every endpoint's shape, SSE
streams that add up to the non-streamed answer, every error class, isolation of bad requests,
client disconnects, and graceful shutdown on SIGTERM (last: it stops the module's engine). The
engine comes from conftest.py, shared with test_engine.py."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import signal
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any, cast

import aiohttp
import pytest

from kestrel_jax.cli import api_key, build_parser, compile_cache_dir
from kestrel_jax.models.config import tiny_config
from kestrel_jax.models.image_crops import DEMO_IMAGE_PATH
from kestrel_jax.serving.engine import EngineBusy, EngineError, InferenceEngine, Stream
from kestrel_jax.serving.server import (
    RequestError,
    Server,
    ServerConfig,
    decode_buckets_up_to,
    engine_config,
    parse_body,
    serve,
)

DEMO_B64 = base64.b64encode(DEMO_IMAGE_PATH.read_bytes()).decode()
DEMO_URL = f"data:image/png;base64,{DEMO_B64}"
GREEDY = {"temperature": 0.0, "max_tokens": 6}
METRIC_KEYS = {"ttft_ms", "prefill_time_ms", "decode_time_ms", "queue_time_ms", "input_tokens", "output_tokens",
               "cached_tokens", "tokens_per_s"}


@contextlib.asynccontextmanager
async def running(engine: Any, **cfg: Any) -> AsyncIterator[tuple[Server, aiohttp.ClientSession]]:
    server = Server(engine, ServerConfig(port=0, **cfg))
    await server.start()
    try:
        async with aiohttp.ClientSession(base_url=server.url) as session:
            yield server, session
    finally:
        await server.stop(grace_s=5, shutdown_engine=False)


async def post(session: aiohttp.ClientSession, path: str, body: Any) -> tuple[int, Any]:
    kw: dict[str, Any] = {"data": body} if isinstance(body, bytes | str) else {"json": body}
    async with session.post(path, **kw) as r:
        return r.status, await r.json()


async def post_sse(session: aiohttp.ClientSession, path: str, body: Any) -> list[dict[str, Any]]:
    async with session.post(path, json={**body, "stream": True}) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        text = await r.text()
    events = [e for e in text.split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events), text
    return [json.loads(e[len("data: "):]) for e in events]


def _check_common(out: dict[str, Any]) -> None:
    assert set(out["metrics"]) == METRIC_KEYS
    assert isinstance(out["request_id"], str) and out["request_id"]
    assert out["finish_reason"] in ("stop", "length")


def _leak_free(engine: InferenceEngine) -> None:
    engine._worker.scheduler.check_invariants()
    assert engine.stats["live"] == 0


# ------------------------------------------------------------------------------------ endpoints
def test_every_endpoint_shape(engine: InferenceEngine) -> None:
    async def main() -> dict[str, tuple[int, Any]]:
        async with running(engine, model_name="tiny") as (_, s):
            out: dict[str, tuple[int, Any]] = {}
            async with s.get("/health") as r:
                out["health"] = (r.status, await r.json())
            async with s.get("/v1/models") as r:
                out["models"] = (r.status, await r.json())
            out["query"] = await post(s, "/v1/query", {"image_url": DEMO_URL, "question": "What is this?",
                                                       "reasoning": False, "settings": GREEDY})
            out["reasoning"] = await post(s, "/v1/query", {"image": DEMO_B64, "question": "How many?",
                                                           "reasoning": True, "settings": GREEDY})
            out["text_only"] = await post(s, "/v1/query", {"question": "Hello", "settings": {"max_tokens": 3}})
            out["caption"] = await post(s, "/v1/caption", {"image": DEMO_URL, "length": "short",
                                                           "settings": GREEDY})
            out["detect"] = await post(s, "/v1/detect", {"image_url": DEMO_URL, "object": "car",
                                                         "settings": {"max_objects": 2}})
            out["point"] = await post(s, "/v1/point", {"image_url": DEMO_URL, "object": "sun",
                                                       "settings": {"max_objects": 2}})
            out["segment"] = await post(s, "/v1/segment", {"image_url": DEMO_URL, "object": "sun",
                                                           "spatial_refs": [[0.1, 0.2, 0.5, 0.6]],
                                                           "settings": {"max_tokens": 4}})
            return out

    out = asyncio.run(main())
    status, health = out["health"]
    assert status == 200 and health["status"] == "ok" and health["in_flight"] == 0
    assert health["engine"]["num_pages"] == 96 and "scheduler" in health["engine"]
    assert out["models"] == (200, {"object": "list", "data": [{"id": "tiny", "object": "model", "family": "md3",
                                                              "synthetic": False, "context_length": 1024,
                                                              "skills": ["query", "caption", "detect", "point",
                                                                         "segment"]}]})
    for name in ("query", "reasoning", "text_only", "caption", "detect", "point", "segment"):
        assert out[name][0] == 200, (name, out[name])
        _check_common(out[name][1])
    q = out["query"][1]
    assert isinstance(q["answer"], str) and "reasoning" not in q and q["metrics"]["output_tokens"] == 6
    r = out["reasoning"][1]
    assert isinstance(r["reasoning"]["text"], str) and isinstance(r["reasoning"]["grounding"], list)
    assert out["text_only"][1]["metrics"]["input_tokens"] < 100  # no image prefix
    assert isinstance(out["caption"][1]["caption"], str)
    assert len(out["detect"][1]["objects"]) <= 2 and len(out["point"][1]["points"]) <= 2
    for box in out["detect"][1]["objects"]:
        assert set(box) == {"x_min", "y_min", "x_max", "y_max"}
        assert all(0.0 <= v <= 1.0 for v in box.values()), box  # clamped to the image, as Kestrel's
    for pt in out["point"][1]["points"]:
        assert set(pt) == {"x", "y"}
    (seg,) = out["segment"][1]["segments"]
    assert seg["object"] == "sun" and isinstance(seg["svg_path"], str) and len(seg["token_ids"]) <= 4
    assert out["segment"][1]["metrics"]["output_tokens"] == 4 or out["segment"][1]["finish_reason"] == "stop"
    _leak_free(engine)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text -> {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
            for fam in text_string_to_metric_families(text) for smp in fam.samples}


def test_metrics_count_requests_tokens_and_engine_state(engine: InferenceEngine) -> None:
    """GET /metrics: per-skill request counts by status (a stream, a 400 and an unknown path among
    them), latency and TTFT histograms, token counters that add up to the responses' metrics, and
    the engine's state read at the scrape (nothing running after, every page used or free)."""
    async def main() -> tuple[list[tuple[int, Any]], list[dict[str, Any]], str, str]:
        async with running(engine) as (_, s):
            outs = [await post(s, "/v1/query", {"image_url": DEMO_URL, "question": "What is this?",
                                                "reasoning": False, "settings": GREEDY}),
                    await post(s, "/v1/query", {"image_url": DEMO_URL, "question": "   "}),
                    await post(s, "/v1/nothing", {}),
                    await post(s, "/v1/point", {"image_url": DEMO_URL, "object": "sun",
                                                "settings": {"max_objects": 1}})]
            events = await post_sse(s, "/v1/caption", {"image_url": DEMO_URL, "length": "short",
                                                       "settings": GREEDY})
            async with s.get("/metrics") as r:
                assert r.status == 200
                ctype, text = r.headers["Content-Type"], await r.text()
            return outs, events, ctype, text

    outs, events, ctype, text = asyncio.run(main())
    assert ctype.startswith("text/plain") and "version=" in ctype
    assert [o[0] for o in outs] == [200, 400, 404, 200]
    m = _samples(text)

    def get(name: str, **labels: str) -> float:
        return m.get((name, tuple(sorted(labels.items()))), 0.0)

    assert get("kestrel_requests_total", skill="query", status="200") == 1
    assert get("kestrel_requests_total", skill="query", status="400") == 1
    assert get("kestrel_requests_total", skill="other", status="404") == 1
    assert get("kestrel_requests_total", skill="point", status="200") == 1
    assert get("kestrel_requests_total", skill="caption", status="200") == 1
    assert get("kestrel_request_duration_seconds_count", skill="query") == 2
    assert get("kestrel_request_duration_seconds_count", skill="caption") == 1
    q, final = outs[0][1]["metrics"], events[-1]
    assert get("kestrel_tokens_total", skill="query", kind="output") == q["output_tokens"] == 6
    assert get("kestrel_tokens_total", skill="query", kind="input") == q["input_tokens"]
    assert get("kestrel_tokens_total", skill="caption", kind="output") == final["metrics"]["output_tokens"]
    assert get("kestrel_finished_requests_total", skill="caption", reason=final["finish_reason"]) == 1
    assert get("kestrel_time_to_first_token_seconds_count", skill="query") == 1
    assert 0 < get("kestrel_time_to_first_token_seconds_sum", skill="query") <= get(
        "kestrel_request_duration_seconds_sum", skill="query")
    assert get("kestrel_http_in_flight_requests") == 0
    assert get("kestrel_engine_up") == 1
    assert get("kestrel_engine_requests", state="running") == 0 == get("kestrel_engine_requests", state="waiting")
    assert get("kestrel_engine_requests_held") == 0 and get("kestrel_engine_requests_limit") == engine.max_requests
    cap = get("kestrel_kv_pages_capacity")
    assert cap == 96 and get("kestrel_kv_pages", state="used") + get("kestrel_kv_pages", state="free") == cap
    assert get("kestrel_scheduler_requests_total", event="admitted") >= 3
    assert get("kestrel_engine_steps_total", kind="prefill") >= 1
    assert get("kestrel_engine_steps_total", kind="decode") >= 1
    assert get("kestrel_prefix_cache_hits_total") >= 1  # the same image three times
    assert get("kestrel_images_encoded_total", crops="device") + get("kestrel_images_encoded_total", crops="host") >= 1
    _leak_free(engine)


def test_api_key_guards_the_v1_endpoints_only(engine: InferenceEngine) -> None:
    """ServerConfig.api_key: /v1/ wants 'Authorization: Bearer <key>' (401 with WWW-Authenticate
    otherwise, counted in the metrics); /health and /metrics stay open."""
    body = {"question": "Hi", "settings": {"max_tokens": 2}}

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with running(engine, api_key="s3cret") as (_, s):
            for name, headers in (("none", {}), ("wrong", {"Authorization": "Bearer nope"}),
                                  ("basic", {"Authorization": "Basic s3cret"}),
                                  ("right", {"Authorization": "Bearer s3cret"})):
                async with s.post("/v1/query", json=body, headers=headers) as r:
                    out[name] = (r.status, await r.json(), r.headers.get("WWW-Authenticate"))
            async with s.get("/v1/models") as r:
                out["models"] = r.status
            async with s.get("/health") as r:
                out["health"] = r.status
            async with s.get("/metrics") as r:
                out["metrics"] = (r.status, await r.text())
        return out

    out = asyncio.run(main())
    for name in ("none", "wrong", "basic"):
        status, err, challenge = out[name]
        assert status == 401 and err["error"]["type"] == "unauthorized" and challenge == "Bearer", (name, out[name])
    assert out["right"][0] == 200 and isinstance(out["right"][1]["answer"], str)
    assert out["models"] == 401 and out["health"] == 200 and out["metrics"][0] == 200
    assert 'kestrel_requests_total{skill="query",status="401"} 3.0' in out["metrics"][1]
    with pytest.raises(ValueError, match="api_key"):
        ServerConfig(api_key=" ").validate()
    _leak_free(engine)


def test_sse_stream_concatenates_to_the_non_streamed_answer(engine: InferenceEngine) -> None:
    q = {"image_url": DEMO_URL, "question": "Describe it", "reasoning": False, "settings": GREEDY}
    c = {"image_url": DEMO_URL, "length": "normal", "settings": GREEDY}

    async def main() -> tuple[Any, Any, list[dict[str, Any]], list[dict[str, Any]]]:
        async with running(engine) as (_, s):
            plain_q, plain_c = (await post(s, "/v1/query", q))[1], (await post(s, "/v1/caption", c))[1]
            return plain_q, plain_c, await post_sse(s, "/v1/query", q), await post_sse(s, "/v1/caption", c)

    plain_q, plain_c, events_q, events_c = asyncio.run(main())
    for plain, events, key in ((plain_q, events_q, "answer"), (plain_c, events_c, "caption")):
        *chunks, final = events
        assert chunks and all(e["completed"] is False and set(e) == {"chunk", "completed"} for e in chunks)
        assert final["completed"] is True and "error" not in final
        assert "".join(e["chunk"] for e in chunks) == final[key] == plain[key]
        _check_common(final)
    _leak_free(engine)


# ------------------------------------------------------------------------------------ errors
BAD: list[tuple[str, Any, int, str, str]] = [
    ("/v1/query", {"image": "not base64!!", "question": "Hi"}, 400, "invalid_image", "base64"),
    ("/v1/query", {"image": base64.b64encode(b"\x89PNG garbage").decode(), "question": "Hi"}, 400,
     "invalid_image", ""),
    ("/v1/query", {"image_url": "https://example.com/a.png", "question": "Hi"}, 400, "invalid_image", "remote"),
    ("/v1/query", {"image_url": DEMO_B64, "question": "Hi"}, 400, "invalid_image", "data URL"),
    ("/v1/query", {"image_url": DEMO_URL, "image": DEMO_B64, "question": "Hi"}, 400, "invalid_request", "not both"),
    ("/v1/query", {"image_url": DEMO_URL, "question": ""}, 400, "invalid_prompt", "question"),
    ("/v1/query", {"image_url": DEMO_URL}, 400, "invalid_request", "'question'"),
    ("/v1/query", {"image_url": DEMO_URL, "question": "Hi", "settings": {"temperature": -1}}, 400,
     "invalid_settings", "temperature"),
    ("/v1/query", {"image_url": DEMO_URL, "question": "Hi", "settings": {"bogus": 1}}, 400,
     "invalid_settings", "bogus"),
    ("/v1/query", {"image_url": DEMO_URL, "question": "Hi", "settings": {"max_tokens": 10**9}}, 400,
     "invalid_settings", "context"),
    ("/v1/query", {"image_url": DEMO_URL, "question": "Hi", "settings": [1]}, 400, "invalid_request", "settings"),
    ("/v1/query", {"image_url": DEMO_URL, "question": "Hi", "stream": "yes"}, 400, "invalid_request", "stream"),
    ("/v1/query", {"image_url": DEMO_URL, "question": "Hi", "temperature": 0}, 400, "invalid_request",
     "temperature"),
    ("/v1/query", {"question": "Hi", "spatial_refs": [[0.5]]}, 400, "invalid_prompt", ""),
    ("/v1/caption", {"image_url": DEMO_URL, "length": "epic"}, 400, "invalid_prompt", "epic"),
    ("/v1/caption", {"length": "short"}, 400, "invalid_request", "missing the image"),
    ("/v1/detect", {"image_url": DEMO_URL}, 400, "invalid_request", "'object'"),
    ("/v1/point", {"image_url": DEMO_URL, "object": "x", "stream": True}, 400, "invalid_request", "stream"),
    ("/v1/segment", {"image_url": DEMO_URL, "object": "x", "spatial_refs": [[2, 0]]}, 400, "invalid_prompt",
     "[0, 1]"),
    ("/v1/segment", {"image_url": DEMO_URL, "object": "x", "settings": {"max_tokens": 900}}, 400,
     "invalid_settings", "max_tokens"),
    ("/v1/query", b"{not json", 400, "invalid_json", "JSON"),
    ("/v1/query", b"", 400, "invalid_json", "empty"),
    ("/v1/query", b"[1, 2]", 400, "invalid_json", "object"),
    ("/v1/nope", {}, 404, "not_found", "/v1/nope"),
]


def test_each_bad_request_gets_its_status_and_message(engine: InferenceEngine) -> None:
    async def main() -> list[tuple[int, Any]]:
        async with running(engine) as (_, s):
            out = [await post(s, path, body) for path, body, *_ in BAD]
            async with s.get("/v1/query") as r:
                out.append((r.status, await r.json()))
            return out

    out = asyncio.run(main())
    want = [(status, kind, text) for *_, status, kind, text in BAD] + [(405, "method_not_allowed", "GET")]
    for (status, body), (w_status, w_kind, w_text), case in zip(out, want, [*BAD, "GET"], strict=True):
        assert status == w_status and body["error"]["type"] == w_kind, (case, body)
        assert w_text in body["error"]["message"], (case, body)
    _leak_free(engine)


def test_oversized_body_is_refused(engine: InferenceEngine) -> None:
    big = {"image": base64.b64encode(b"\0" * 100_000).decode(), "question": "Hi"}

    async def main() -> tuple[int, Any]:
        async with running(engine, max_body_bytes=64 * 1024) as (_, s):
            return await post(s, "/v1/query", big)

    status, body = asyncio.run(main())
    assert status == 413 and body["error"]["type"] == "request_too_large"
    assert "65536 bytes" in body["error"]["message"]


def test_bad_requests_among_good_ones_fail_alone(engine: InferenceEngine) -> None:
    good = {"image_url": DEMO_URL, "question": "What color?", "reasoning": False, "settings": GREEDY}
    bad = [{"image": "%%%", "question": "x"}, {"image_url": DEMO_URL, "question": "x", "settings": {"top_p": 2}},
           {"image_url": DEMO_URL, "question": ""}]

    async def main() -> tuple[Any, list[tuple[int, Any]]]:
        async with running(engine) as (_, s):
            alone = (await post(s, "/v1/query", good))[1]
            calls = [post(s, "/v1/query", good) for _ in range(4)] + [post(s, "/v1/query", b) for b in bad]
            calls.append(post(s, "/v1/point", {"image_url": DEMO_URL, "object": "sun", "settings": {"max_objects": 1}}))
            return alone, list(await asyncio.gather(*calls))

    alone, out = asyncio.run(main())
    for status, body in out[:4]:
        assert status == 200 and body["answer"] == alone["answer"]
    assert [status for status, _ in out[4:7]] == [400, 400, 400]
    assert out[7][0] == 200 and len(out[7][1]["points"]) <= 1
    assert len({body["request_id"] for _, body in out[:4]}) == 4
    _leak_free(engine)


class _FailingEngine:
    """Stands in for the engine where the real one cannot be made to fail on demand."""

    cfg = SimpleNamespace(name="fake", family="md3", tokenizer=tiny_config("md3").tokenizer)
    stats: dict[str, Any] = {}

    def __init__(self, exc: BaseException):
        self.exc = exc

    async def query(self, *args: Any, **kwargs: Any) -> Any:
        raise self.exc

    async def shutdown(self) -> None:
        pass


def test_engine_failures_map_to_5xx_without_leaking(caplog: pytest.LogCaptureFixture) -> None:
    cases = [(RuntimeError("secret internals at 0xdead"), 500, "internal_error"),
             (EngineError("the engine is not running"), 503, "engine_unavailable"),
             (TimeoutError("request deadline passed"), 504, "timeout"),
             (EngineBusy("the engine holds 1088 requests"), 503, "overloaded")]

    retry_after: list[str | None] = []

    async def main() -> list[tuple[int, Any]]:
        out = []
        for exc, *_ in cases:
            async with (running(cast(InferenceEngine, _FailingEngine(exc))) as (_, s),
                        s.post("/v1/query", json={"question": "Hi"}) as r):
                out.append((r.status, await r.json()))
                retry_after.append(r.headers.get("Retry-After"))
        async with running(cast(InferenceEngine, _FailingEngine(RuntimeError()))) as (server, s):
            server.draining = True
            out.append(await post(s, "/v1/query", {"question": "Hi"}))
            async with s.get("/health") as r:
                out.append((r.status, await r.json()))
        return out

    with caplog.at_level(logging.ERROR, logger="kestrel_jax.serving.server"):
        out = asyncio.run(main())
    for (status, body), (_, w_status, w_kind) in zip(out, cases, strict=False):
        assert status == w_status and body["error"]["type"] == w_kind, body
    assert "secret" not in json.dumps(out[0][1]) and "Traceback" not in json.dumps(out[0][1])
    assert "secret internals" in caplog.text  # logged with its traceback on the server side
    assert retry_after == [None, None, None, "1"]  # only "overloaded" asks the client to come back
    assert out[4][0] == 503 and out[4][1]["error"]["type"] == "shutting_down"
    assert out[5][0] == 503 and out[5][1]["status"] == "draining"


class _BrokenStreamEngine(_FailingEngine):
    """Streams two chunks, then the request fails (as when the engine stops mid-stream)."""

    async def query(self, *args: Any, **kwargs: Any) -> Any:
        assert kwargs["stream"] is True
        stream = Stream(asyncio.get_running_loop().create_future())
        for chunk in ("a", "b"):
            stream.feed.push(chunk)

        def fail() -> None:
            stream.feed.future.set_exception(self.exc)
            stream.feed.push(None)

        asyncio.get_running_loop().call_later(0.05, fail)
        return stream


def test_failure_after_the_stream_began_ends_it_with_an_error_event(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
        out = []
        for exc in (EngineError("the engine was shut down"), RuntimeError("secret internals")):
            async with running(cast(InferenceEngine, _BrokenStreamEngine(exc))) as (_, s):
                out.append(await post_sse(s, "/v1/query", {"question": "Hi"}))
                async with s.get("/metrics") as r:
                    text = await r.text()
        return out[0], out[1], text

    with caplog.at_level(logging.ERROR, logger="kestrel_jax.serving.server"):
        shut, broken, metrics = asyncio.run(main())
    # counted by the status its error maps to, not the 200 the stream began with
    assert 'kestrel_requests_total{skill="query",status="500"} 1.0' in metrics and 'status="200"' not in metrics
    assert [e.get("chunk") for e in shut[:2]] == ["a", "b"]
    want = {"type": "engine_unavailable", "message": "the engine was shut down"}
    assert shut[2] == {"completed": True, "error": want}
    assert broken[2]["error"]["type"] == "internal_error" and "secret" not in json.dumps(broken)
    assert "secret internals" in caplog.text


def test_deadline_gives_504(engine: InferenceEngine) -> None:
    async def main() -> tuple[int, Any]:
        async with running(engine, request_timeout_s=1e-6) as (_, s):
            return await post(s, "/v1/query", {"question": "Hi", "settings": {"max_tokens": 50}})

    status, body = asyncio.run(main())
    assert status == 504 and body["error"]["type"] == "timeout"
    _leak_free(engine)


def test_client_disconnect_mid_stream_cancels_the_request(engine: InferenceEngine) -> None:
    sched = engine._worker.scheduler
    before = sched.stats.cancelled

    async def main() -> tuple[int, Any]:
        async with running(engine) as (server, s):
            body = {"question": "Tell me a long story", "reasoning": False, "stream": True,
                    "settings": {"temperature": 0.0, "max_tokens": 900}}
            async with s.post("/v1/query", json=body) as r:
                line = await r.content.readline()
                assert line.startswith(b"data: ") and b'"chunk"' in line
                r.close()  # drop the connection mid-stream
            t0 = time.monotonic()
            while (sched.stats.cancelled == before or engine.stats["live"]) and time.monotonic() - t0 < 60:
                await asyncio.sleep(0.05)
            while server.in_flight and time.monotonic() - t0 < 60:
                await asyncio.sleep(0.05)
            return await post(s, "/v1/query", {"question": "Still there?", "reasoning": False,
                                                 "settings": {"max_tokens": 2}})

    status, body = asyncio.run(main())
    assert sched.stats.cancelled == before + 1
    assert status == 200 and body["metrics"]["output_tokens"] == 2
    _leak_free(engine)


def test_client_hanging_up_before_a_reply_cancels_the_request(engine: InferenceEngine) -> None:
    """A client that hangs up while waiting for a (non-streamed) reply cancels its handler
    (aiohttp's handler_cancellation) and so its engine request, counted as 499."""
    sched = engine._worker.scheduler
    before = sched.stats.cancelled

    async def main() -> tuple[str, int]:
        async with running(engine) as (server, s):
            body = {"question": "Tell me a long story", "reasoning": False,
                    "settings": {"temperature": 0.0, "max_tokens": 900, "ignore_eos": True}}
            with contextlib.suppress(TimeoutError):
                async with s.post("/v1/query", json=body, timeout=aiohttp.ClientTimeout(total=0.5)) as r:
                    await r.read()
            t0 = time.monotonic()
            while (sched.stats.cancelled == before or engine.held()) and time.monotonic() - t0 < 60:
                await asyncio.sleep(0.05)
            while server.in_flight and time.monotonic() - t0 < 60:
                await asyncio.sleep(0.05)
            async with s.get("/metrics") as r:
                return await r.text(), server.in_flight

    metrics, in_flight = asyncio.run(main())
    assert sched.stats.cancelled == before + 1 and in_flight == 0
    assert 'kestrel_requests_total{skill="query",status="499"} 1.0' in metrics
    _leak_free(engine)


# ------------------------------------------------------------------------------------ pieces
def test_parse_body_accepts_wrapped_base64_and_data_urls() -> None:
    wrapped = "\n".join(DEMO_B64[i:i + 76] for i in range(0, len(DEMO_B64), 76))
    a = parse_body(json.dumps({"image": wrapped, "question": "q"}).encode(), "query")
    b = parse_body(json.dumps({"image_url": DEMO_URL, "object": "o"}).encode(), "detect")
    assert a.image == b.image == DEMO_IMAGE_PATH.read_bytes()
    assert a.kwargs == {"settings": None, "priority": 0, "question": "q", "reasoning": None, "spatial_refs": ()}
    assert b.kwargs == {"settings": None, "priority": 0, "object": "o"} and not a.stream
    assert parse_body(b'{"question": "q", "priority": -3}', "query").kwargs["priority"] == -3
    with pytest.raises(RequestError, match="must be bool"):
        parse_body(b'{"question": "q", "reasoning": 1}', "query")
    with pytest.raises(RequestError, match="'priority' must be int"):
        parse_body(b'{"question": "q", "priority": "high"}', "query")
    with pytest.raises(RequestError, match="'priority' must be int"):
        parse_body(b'{"question": "q", "priority": true}', "query")
    with pytest.raises(RequestError, match="must be a data URL"):
        parse_body(b'{"question": "q", "image_url": "/etc/passwd"}', "query")


def test_cli_serve_options_build_the_engine_config() -> None:
    args = build_parser().parse_args(["serve", "--port", "9001", "--max-batch-size", "12", "--kv-dtype", "fp8",
                                      "--page-size", "32", "--no-prefix-cache", "--dtype", "float32"])
    assert args.port == 9001 and args.model is None and args.host == "127.0.0.1"
    cfg = engine_config(args.model, dtype=args.dtype, kv_dtype=args.kv_dtype, page_size=args.page_size,
                        max_batch_size=args.max_batch_size, prefix_cache=not args.no_prefix_cache)
    assert cfg.decode_buckets == (1, 2, 4, 8, 12) and cfg.runner.kv_dtype == "fp8" and cfg.runner.page_size == 32
    assert not cfg.enable_prefix_cache and cfg.dtype == "float32" and cfg.model_path is None
    assert decode_buckets_up_to(1) == (1,) and decode_buckets_up_to(128)[-2:] == (64, 128)
    with pytest.raises(ValueError, match=">= 1"):
        decode_buckets_up_to(0)
    with pytest.raises(ValueError, match="port"):
        ServerConfig(port=70000).validate()
    # the compiled-step cache: on by default under the cache root, a directory, or off
    assert cfg.runner.compilation_cache_dir is None  # engine_config's own default
    default = compile_cache_dir(build_parser().parse_args(["serve"]).compile_cache)
    assert default is not None and default.endswith("compile")
    assert compile_cache_dir("/x/cc") == "/x/cc" and compile_cache_dir("none") is None
    cfg = engine_config(None, compile_cache="/x/cc")
    assert cfg.runner.compilation_cache_dir == "/x/cc"
    # the API key: the flag, else the environment, else none
    assert api_key(build_parser().parse_args(["serve", "--api-key", "k1"])) == "k1"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KESTREL_JAX_API_KEY", "k2")
        assert api_key(build_parser().parse_args(["serve"])) == "k2"
        mp.delenv("KESTREL_JAX_API_KEY")
        assert api_key(build_parser().parse_args(["serve"])) is None
    # the queue limit: 1024 by default, a flag, -1 for none (cmd_serve maps it to None)
    assert build_parser().parse_args(["serve"]).max_queued == 1024 == cfg.max_queued
    assert build_parser().parse_args(["serve", "--max-queued", "16"]).max_queued == 16
    assert engine_config(None, max_queued=16).max_queued == 16
    assert engine_config(None, max_queued=None).max_queued is None
    with pytest.raises(ValueError, match="max queued"):
        engine_config(None, max_queued=-2)


# ------------------------------------------------------------------------------------ last: shutdown
def test_sigterm_drains_in_flight_requests_then_stops_the_engine(engine: InferenceEngine,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> tuple[int, Any, bool, tuple[int, Any], tuple[int, Any]]:
        started: asyncio.Future[Server] = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(serve(engine, ServerConfig(port=0, shutdown_grace_s=120),
                                           on_started=started.set_result))
        server = await started
        async with aiohttp.ClientSession(base_url=server.url) as s:
            long = asyncio.ensure_future(post(s, "/v1/query", {"question": "Count to many", "reasoning": False,
                                                               "settings": {"temperature": 0.0, "max_tokens": 200}}))
            while server.in_flight == 0:
                await asyncio.sleep(0.01)
            signal.raise_signal(signal.SIGTERM)
            status, body = await long
        await task
        refused = False
        try:
            async with aiohttp.ClientSession() as s:
                await s.get(server.url + "/health")
        except aiohttp.ClientConnectionError:
            refused = True
        # The engine is down now: a fresh server over it answers 503.
        async with running(engine) as (_, s):
            after = await post(s, "/v1/query", {"question": "Hi"})
            async with s.get("/health") as r:
                health = (r.status, await r.json())
        return status, body, refused, after, health

    with caplog.at_level(logging.INFO, logger="kestrel_jax.serving.server"):
        status, body, refused, after, health = asyncio.run(main())
    assert "draining 1 in-flight request" in caplog.text and "server stopped" in caplog.text
    assert status == 200 and body["metrics"]["output_tokens"] == 200
    assert refused
    assert after[0] == 503 and after[1]["error"]["type"] == "engine_unavailable"
    assert health[0] == 503 and health[1]["status"] == "unavailable"
    with pytest.raises(EngineError):
        asyncio.run(engine.query(None, "Hi"))

