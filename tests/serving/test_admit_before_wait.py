"""EngineConfig.admit_before_wait: requests that arrive while a step is being launched are taken
from the inbox before the engine thread waits for the previous step's outputs (counted in
`stats["admitted_before_wait"]`), and they answer as the reference does; with the setting off the
same arrivals wait for the next loop iteration. EncodeAhead's side (an urgent image's call starts
without waiting for a fuller batch) is tested in test_encode_ahead.py."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

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


@pytest.fixture(scope="module", params=[True, False], ids=["before_wait", "next_iteration"])
def setup(request: pytest.FixtureRequest) -> Iterator[tuple[InferenceEngine, ReferenceMoondream, bool]]:
    model = random_model(tiny_config("md2", vision_layers=2), dtype=jnp.float32, seed=13)
    tok = Tokenizer(build_synthetic_tokenizer(model.cfg.text.vocab_size))
    # a long batch wait: an image is encoded early only if it is urgent (or asked for by its prefill)
    cfg = EngineConfig(runner=RunnerConfig(num_pages=64, kv_dtype="f32", max_seq_len=1024, vision_buckets=(2,)),
                       decode_buckets=(1, 4), prefill_token_buckets=(1024,), max_prefill_seqs=2, decode_steps=1,
                       vision_thread=True, vision_batch_wait_ms=10_000.0, admit_before_wait=request.param)
    eng = asyncio.run(InferenceEngine.create(cfg, model=model, tokenizer=tok))
    yield eng, ReferenceMoondream(model, tok), request.param
    asyncio.run(eng.shutdown())


def test_arrivals_during_a_launch_are_admitted_before_the_wait(
        setup: tuple[InferenceEngine, ReferenceMoondream, bool]) -> None:
    eng, ref, on = setup
    w = eng._worker
    dispatch = w.stepper.dispatch
    hold, held, release = threading.Event(), threading.Event(), threading.Event()

    def gated(plan: Any, pending: Any) -> Any:
        out = dispatch(plan, pending)
        if hold.is_set() and pending is not None:  # a step launched with another in flight
            hold.clear()
            held.set()
            assert release.wait(60)
        return out

    w.stepper.dispatch = gated
    rng = np.random.default_rng(7)
    imgs = [rng.integers(0, 255, (300, 340, 3), dtype=np.uint8) for _ in range(2)]
    before = w.admitted_before_wait
    settings = {"temperature": 0.0, "max_tokens": 5}

    async def run() -> list[Any]:
        text = asyncio.create_task(eng.query(None, "Tell me a story.", reasoning=False,
                                             settings={"temperature": 0.0, "max_tokens": 60}))
        while eng.stats["steps"]["decode_iterations"] == 0:
            await asyncio.sleep(0.01)
        hold.set()
        while not held.is_set():
            await asyncio.sleep(0.01)
        queries = [asyncio.create_task(eng.query(im, "What is this?", reasoning=False, settings=settings))
                   for im in imgs]
        while w._inbox.qsize() < len(imgs):  # both submitted while the launch is held
            await asyncio.sleep(0.01)
        release.set()
        return [await text, *[await q for q in queries]]

    try:
        results = asyncio.run(run())
    finally:
        release.set()
        del w.stepper.dispatch
    assert all(isinstance(r, Result) for r in results)
    taken = w.admitted_before_wait - before
    assert taken == (len(imgs) if on else 0), taken
    assert eng.stats["admitted_before_wait"] == w.admitted_before_wait
    s = SamplingSettings(temperature=0.0, max_tokens=5)
    for im, r in zip(imgs, results[1:], strict=True):
        assert r.output["answer"] == ref.query(im, "What is this?", reasoning=False, settings=s).output
    s60 = SamplingSettings(temperature=0.0, max_tokens=60)
    assert results[0].output["answer"] == ref.query(None, "Tell me a story.", reasoning=False, settings=s60).output
    assert w._live == {} and w._ahead is not None and w._ahead.pending == 0
    w.scheduler.check_invariants()
