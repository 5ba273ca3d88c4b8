"""EngineConfig.vision_thread: images are encoded on a worker thread as their requests arrive. The
outputs are the reference's; requests on one image share one encoding; an image the prefix cache
holds is not encoded again; nothing is left behind when requests end or are cancelled."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import jax.numpy as jnp
import numpy as np
import pytest

from kestrel_jax.generate import SamplingSettings
from kestrel_jax.models.config import tiny_config
from kestrel_jax.models.moondream import random_model
from kestrel_jax.reference import ReferenceMoondream
from kestrel_jax.serving.engine import EngineConfig, InferenceEngine, Result
from kestrel_jax.serving.runner import RunnerConfig
from kestrel_jax.tokenizer import Tokenizer, build_synthetic_tokenizer

GREEDY = {"temperature": 0.0, "max_tokens": 4}


@pytest.fixture(scope="module")
def setup() -> Iterator[tuple[InferenceEngine, ReferenceMoondream]]:
    model = random_model(tiny_config("md2", vision_layers=2), dtype=jnp.float32, seed=9)
    tok = Tokenizer(build_synthetic_tokenizer(model.cfg.text.vocab_size))
    cfg = EngineConfig(runner=RunnerConfig(num_pages=64, kv_dtype="f32", max_seq_len=1024, vision_buckets=(2,)),
                       # decode_steps=4: the MD2 engine tests' multi-step variant (their programs are shared)
                       decode_buckets=(1, 4), prefill_token_buckets=(1024,), max_prefill_seqs=2, decode_steps=4,
                       vision_thread=True,
                       vision_ahead=1)  # the window: the second image waits for the first one's prefill
    eng = asyncio.run(InferenceEngine.create(cfg, model=model, tokenizer=tok))
    yield eng, ReferenceMoondream(model, tok)
    asyncio.run(eng.shutdown())


def _encoded(eng: InferenceEngine) -> int:
    return sum(eng.stats["images"].values())


def _img(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (300, 340, 3), dtype=np.uint8)


def test_outputs_equal_the_reference_and_one_image_is_encoded_once(
        setup: tuple[InferenceEngine, ReferenceMoondream]) -> None:
    eng, ref = setup
    a, b = _img(1), _img(2)
    before = _encoded(eng)
    runner = eng._worker.runner
    threads: list[str] = []
    encode = runner.encode_image

    def recorded(*args: object) -> object:
        threads.append(threading.current_thread().name)
        return encode(*args)

    runner.encode_image = recorded

    async def run() -> list[Result]:
        rs = await asyncio.gather(
            eng.query(a, "What is this?", reasoning=False, settings=GREEDY),
            eng.query(a, "Why?", reasoning=False, settings=GREEDY),
            eng.caption(a, length="short", settings=GREEDY),
            eng.point(b, "sun", settings={"max_objects": 1}))
        return [r for r in rs if isinstance(r, Result)]

    try:
        q1, q2, cap, pt = asyncio.run(run())
    finally:
        del runner.encode_image
    assert len(threads) == 2 and all(t.startswith("kestrel-jax-vision") for t in threads), threads
    s = SamplingSettings(temperature=0.0, max_tokens=4)
    assert q1.output["answer"] == ref.query(a, "What is this?", reasoning=False, settings=s).output
    assert q2.output["answer"] == ref.query(a, "Why?", reasoning=False, settings=s).output
    assert cap.output["caption"] == ref.caption(a, "short", s).output
    np.testing.assert_allclose([[p["x"], p["y"]] for p in pt.output["points"]],
                               [[p["x"], p["y"]] for p in ref.point(b, "sun", max_objects=1).output], atol=1e-6)
    assert _encoded(eng) == before + 2  # a once for its three requests, b once
    assert eng.stats["encode_ahead"]["started"] >= 2 and eng.stats["encode_ahead"]["pending"] == 0
    ahead = eng._worker._ahead
    assert ahead is not None and ahead.pending == 0 and ahead.waiting == 0
    # a cached image is not encoded again
    r = asyncio.run(eng.query(b, "What is this?", reasoning=False, settings=GREEDY))
    assert isinstance(r, Result) and r.metrics.cached_tokens > 0 and _encoded(eng) == before + 2
    assert r.output["answer"] == ref.query(b, "What is this?", reasoning=False, settings=s).output


def test_cancelled_requests_leave_no_encoding_behind(setup: tuple[InferenceEngine, ReferenceMoondream]) -> None:
    eng, _ = setup

    async def run() -> None:
        tasks = [asyncio.create_task(eng.caption(_img(10 + i), length="normal",
                                                 settings={"temperature": 0.0, "max_tokens": 30}))
                 for i in range(5)]
        await asyncio.sleep(0.05)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # The engine thread sees the cancellations (slow under a loaded CPU). Empty must hold for a
        # while: a submission still in the engine's inbox is not live yet, and is admitted (and
        # its encoding started) before its cancellation is read.
        w, quiet = eng._worker, 0
        for _ in range(1200):
            idle = not w._live and w._inbox.empty() and w._ahead is not None and w._ahead.pending == 0
            quiet = quiet + 1 if idle else 0
            if quiet >= 10:
                break
            await asyncio.sleep(0.05)

    asyncio.run(run())
    worker = eng._worker
    assert worker._live == {} and worker._ahead is not None and worker._ahead.pending == worker._ahead.waiting == 0
    worker.scheduler.check_invariants()
    r = asyncio.run(eng.query(_img(3), "What?", reasoning=False, settings=GREEDY))  # still serving
    assert isinstance(r, Result)
