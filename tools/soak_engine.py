#!/usr/bin/env python3
"""Soak the serving engine with a random mix of traffic, then check that nothing is left behind.

Every skill, streamed and not, text-only queries, a pool of repeated images (prefix-cache hits
and evictions under a small KV pool) and new ones, bad inputs (a corrupt image, a negative
temperature, an empty question), cancellations at random moments (a task cancelled, a stream
abandoned the way the HTTP server abandons one) and short deadlines, all at once from a number of
concurrent clients. Each request must end, within a time limit, in a result or one of the errors
its input calls for; afterwards the engine must hold no request, no page but the prefix cache's and
no encoding, its scheduler's invariants must hold, and a greedy request must give the answer it gave
before the soak.

  PYTHONPATH=. python3 tools/soak_engine.py --seconds 60 --clients 16 [--family md2]  # CPU, tiny synthetic model
  PYTHONPATH=. python3 tools/soak_engine.py --seconds 60 --http   # the same through the HTTP server

With --http the clients talk to `serving.server.Server` over a socket: JSON and SSE, bodies that
are not JSON, images that are not base64, unknown fields, and clients that hang up mid-stream or
before a reply; every reply must be the status its request calls for (200, 400 or 404; a 5xx
fails the soak) and afterwards the server must have nothing in flight.

The test suite runs `soak` for a few seconds on its tiny engine (tests/serving/test_soak.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel_jax.models.image_crops import ImageError  # noqa: E402
from kestrel_jax.prompts import PromptError  # noqa: E402
from kestrel_jax.serving.engine import EngineBusy, InferenceEngine, Result, Stream  # noqa: E402
from kestrel_jax.serving.request import RequestRejected  # noqa: E402
from kestrel_jax.serving.skills import SettingsError  # noqa: E402

KINDS = ("query", "query_stream", "caption", "caption_stream", "detect", "point", "text_only",
         "bad_image", "bad_settings", "bad_prompt")
# What each kind may end in besides a Result (cancellation and deadlines come on top of these).
EXPECTED: dict[str, tuple[type[BaseException], ...]] = {
    "bad_image": (ImageError,), "bad_settings": (SettingsError,), "bad_prompt": (PromptError,)}
CHECK_REQUEST: dict[str, Any] = {"question": "What is in this image?", "reasoning": False,
                                 "settings": {"temperature": 0.0, "max_tokens": 6}}


def _image(rng: random.Random, pool: list[np.ndarray]) -> np.ndarray:
    if rng.random() < 0.75:
        return rng.choice(pool)  # repeated: prefix-cache hits (or misses after an eviction)
    side = rng.choice((200, 378, 500))
    return np.random.default_rng(rng.randrange(1 << 30)).integers(0, 255, (side, side + 40, 3), dtype=np.uint8)


async def _one(engine: InferenceEngine, rng: random.Random, kind: str, pool: list[np.ndarray]) -> Any:
    """One request of `kind`, with its random settings, cancellation and deadline."""
    settings = {"temperature": rng.choice((0.0, 0.5)), "max_tokens": rng.randint(1, 12)}
    deadline = rng.uniform(0.01, 0.5) if rng.random() < 0.1 else None
    image = _image(rng, pool)
    if kind in ("query", "query_stream"):
        call = engine.query(image, rng.choice(("What is this?", "How many?")), reasoning=rng.random() < 0.3,
                            stream=kind.endswith("stream"), settings=settings, deadline_s=deadline)
    elif kind in ("caption", "caption_stream"):
        call = engine.caption(image, length=rng.choice(("short", "normal")), stream=kind.endswith("stream"),
                              settings=settings, deadline_s=deadline)
    elif kind in ("detect", "point"):
        fn = engine.detect if kind == "detect" else engine.point
        call = fn(image, rng.choice(("car", "sun")), settings={"max_objects": rng.randint(1, 3)}, deadline_s=deadline)
    elif kind == "text_only":
        call = engine.query(None, "Hello there", settings=settings, deadline_s=deadline)
    elif kind == "bad_image":
        call = engine.caption(b"\x89PNG\r\n\x1a\n not really", settings=settings)
    elif kind == "bad_settings":
        call = engine.query(image, "What?", settings={"temperature": -1.0})
    else:
        call = engine.query(image, "   ", settings=settings)
    out = await call
    if isinstance(out, Stream):
        chunks = 0
        async for _ in out:
            chunks += 1
            if rng.random() < 0.1:  # abandoned mid-stream, as the server does for a gone client
                engine.cancel(out.request_id)
                break
        return await out.result()
    return out


async def _client(engine: InferenceEngine, rng: random.Random, going: Callable[[], bool], pool: list[np.ndarray],
                  report: dict[str, Any], request_timeout_s: float) -> None:
    while going():
        kind = rng.choice(KINDS)
        task = asyncio.ensure_future(_one(engine, rng, kind, pool))
        cancel_after = rng.uniform(0.0, 0.3) if rng.random() < 0.15 else None
        outcome: str
        try:
            if cancel_after is not None:
                done, _ = await asyncio.wait({task}, timeout=cancel_after)
                if not done:
                    task.cancel()
            res = await asyncio.wait_for(task, request_timeout_s)
            outcome = f"result:{res.finish_reason}" if isinstance(res, Result) else f"odd:{type(res).__name__}"
        except asyncio.CancelledError:
            if cancel_after is None:
                raise
            outcome = "cancelled"
        except TimeoutError as e:
            if task.cancelled():  # wait_for's own timeout (it cancels the task): the request hung
                outcome = "hung"
            else:
                outcome = "deadline" if "deadline" in str(e) else f"unexpected:TimeoutError:{e}"
        except (EngineBusy, RequestRejected) as e:
            outcome = type(e).__name__
        except Exception as e:  # noqa: BLE001 - classified: expected for bad inputs, a failure otherwise
            ok = EXPECTED.get(kind, ())
            outcome = f"expected:{type(e).__name__}" if isinstance(e, ok) else f"unexpected:{type(e).__name__}:{e}"
        report["outcomes"][f"{kind}:{outcome.split(':')[0]}"] += 1
        if outcome.startswith(("unexpected", "hung", "odd")):
            report["failures"].append(f"{kind}: {outcome}")


async def _over_http(engine: InferenceEngine, rng: random.Random, going: Callable[[], bool], pool: list[np.ndarray],
                     report: dict[str, Any], clients: int, request_timeout_s: float) -> None:
    import aiohttp

    from kestrel_jax.serving.server import Server, ServerConfig

    server = Server(engine, ServerConfig(port=0))
    await server.start()
    try:
        images = [_png_b64(img) for img in pool]
        async with aiohttp.ClientSession(base_url=server.url) as session:
            await asyncio.gather(*(_http_client(session, random.Random(rng.randrange(1 << 30)), going, images,
                                                report, request_timeout_s) for _ in range(clients)))
        for _ in range(600):  # handlers of clients that hung up finish on their own
            if server.in_flight == 0:
                break
            await asyncio.sleep(0.05)
        if server.in_flight:
            report["failures"].append(f"the server still has {server.in_flight} requests in flight")
    finally:
        await server.stop(grace_s=5, shutdown_engine=False)


async def _settle(engine: InferenceEngine, timeout_s: float) -> bool:
    """Wait until the engine holds nothing (cancellations are read on its own thread)."""
    w = engine._worker
    quiet = 0
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        idle = engine.held() == 0 and (w._ahead is None or w._ahead.pending == w._ahead.waiting == 0)
        quiet = quiet + 1 if idle else 0
        if quiet >= 5:
            return True
        await asyncio.sleep(0.05)
    return False


HTTP_KINDS = ("query", "query_stream", "caption_stream", "detect", "point", "text_only", "not_json",
              "bad_base64", "unknown_field", "no_endpoint", "hang_up_stream", "hang_up")


def _png_b64(img: np.ndarray) -> str:
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


async def _http_client(session: Any, rng: random.Random, going: Callable[[], bool], images: list[str],
                       report: dict[str, Any], request_timeout_s: float) -> None:
    import aiohttp

    while going():
        kind = rng.choice(HTTP_KINDS)
        settings = {"temperature": rng.choice((0.0, 0.5)), "max_tokens": rng.randint(1, 10)}
        img = rng.choice(images)
        body: dict[str, Any] = {"image": img, "question": "What?", "settings": settings}
        path, want, stream = "/v1/query", 200, False
        if kind in ("caption_stream", "hang_up_stream"):
            path, body, stream = "/v1/caption", {"image": img, "length": "short", "settings": settings}, True
        elif kind in ("detect", "point"):
            path, body = f"/v1/{kind}", {"image": img, "object": "car", "settings": {"max_objects": 2}}
        elif kind == "text_only":
            body = {"question": "Hello", "settings": settings}
        elif kind == "query_stream":
            stream = True
        elif kind == "bad_base64":
            body, want = {**body, "image": "%%% not base64 %%%"}, 400
        elif kind == "unknown_field":
            body, want = {**body, "colour": "red"}, 400
        elif kind == "no_endpoint":
            path, want = "/v1/sing", 404
        if stream:
            body = {**body, "stream": True}
        data = b"{not json" if kind == "not_json" else None
        want = 400 if kind == "not_json" else want
        try:
            timeout = aiohttp.ClientTimeout(total=rng.uniform(0.02, 0.2) if kind == "hang_up" else request_timeout_s)
            async with session.post(path, json=None if data else body, data=data, timeout=timeout) as r:
                if kind == "hang_up_stream" and r.status == 200:
                    await r.content.readline()  # the first event, then the client goes
                    r.close()
                    outcome = "hung_up"
                else:
                    text = await r.text()
                    ok = r.status == want and (not stream or r.status != 200 or '"completed": true' in text)
                    outcome = f"status:{r.status}" if ok else f"unexpected:{r.status}:{text[:200]}"
        except TimeoutError:
            outcome = "hung_up" if kind == "hang_up" else "unexpected:client timeout (a request hung)"
        except aiohttp.ClientError as e:
            outcome = f"unexpected:{type(e).__name__}:{e}"
        report["outcomes"][f"{kind}:{outcome.split(':')[0]}"] += 1
        if outcome.startswith("unexpected"):
            report["failures"].append(f"{kind}: {outcome}")


def soak(engine: InferenceEngine, *, seconds: float, clients: int, seed: int = 0,
         request_timeout_s: float = 120.0, http: bool = False, min_requests: int = 0,
         max_seconds: float | None = None) -> dict[str, Any]:
    """Run the traffic for `seconds` (with `http`, through the HTTP server), and on until at least
    `min_requests` requests have ended (a slower machine still serves the mix a test asks for;
    at most `max_seconds`, default 4 x `seconds`), then check the engine; returns the report
    (`failures` empty when everything held)."""
    rng = random.Random(seed)
    pool = [np.random.default_rng(seed + i).integers(0, 255, (300 + 60 * i, 340, 3), dtype=np.uint8)
            for i in range(3)]
    report: dict[str, Any] = {"outcomes": Counter(), "failures": []}

    async def main() -> None:
        before = await engine.query(pool[0], **CHECK_REQUEST)
        t0 = time.monotonic()
        until, hard_until = t0 + seconds, t0 + (4 * seconds if max_seconds is None else max_seconds)

        def going() -> bool:
            now = time.monotonic()
            return now < until or (sum(report["outcomes"].values()) < min_requests and now < hard_until)

        if http:
            await _over_http(engine, rng, going, pool, report, clients, request_timeout_s)
        else:
            await asyncio.gather(*(_client(engine, random.Random(rng.randrange(1 << 30)), going, pool, report,
                                           request_timeout_s) for _ in range(clients)))
        report["seconds"] = round(time.monotonic() - t0, 1)
        if not await _settle(engine, 60.0):
            report["failures"].append(f"the engine still holds {engine.held()} requests after the soak")
        after = await engine.query(pool[0], **CHECK_REQUEST)
        assert isinstance(before, Result) and isinstance(after, Result)
        if after.output != before.output:
            report["failures"].append(f"the check request changed: {before.output} -> {after.output}")

    asyncio.run(main())
    w = engine._worker
    try:
        w.scheduler.check_invariants()
    except AssertionError as e:
        report["failures"].append(f"scheduler invariants: {e}")
    cache = w.scheduler.prefix_cache
    held_by_cache = len(cache.cached_pages()) if cache is not None else 0
    used = w.scheduler.allocator.num_used
    if used != held_by_cache:
        report["failures"].append(f"{used} pages used, the prefix cache holds {held_by_cache}")
    if not engine.healthy:
        report["failures"].append("the engine is not healthy")
    report["requests"] = sum(report["outcomes"].values())
    report["outcomes"] = dict(sorted(report["outcomes"].items()))
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--family", choices=["md2", "md3"], default="md3")
    ap.add_argument("--http", action="store_true", help="through the HTTP server (needs aiohttp)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import jax.numpy as jnp

    from kestrel_jax.models.config import tiny_config
    from kestrel_jax.models.moondream import random_model
    from kestrel_jax.serving.engine import EngineConfig
    from kestrel_jax.serving.runner import RunnerConfig
    from kestrel_jax.tokenizer import Tokenizer, build_synthetic_tokenizer

    model = random_model(tiny_config(a.family, vision_layers=2), dtype=jnp.float32, seed=3)
    tok = Tokenizer(build_synthetic_tokenizer(model.cfg.text.vocab_size))
    cfg = EngineConfig(runner=RunnerConfig(num_pages=64, kv_dtype="f32", max_seq_len=1024, vision_buckets=(1, 10)),
                       decode_buckets=(1, 4), prefill_token_buckets=(64, 1024), max_prefill_seqs=4, vision_ahead=2)
    engine = asyncio.run(InferenceEngine.create(cfg, model=model, tokenizer=tok))
    try:
        report = soak(engine, seconds=a.seconds, clients=a.clients, seed=a.seed, http=a.http)
    finally:
        with contextlib.suppress(Exception):
            asyncio.run(engine.shutdown())
    print(json.dumps(report, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
