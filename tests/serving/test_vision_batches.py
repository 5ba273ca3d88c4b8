"""One-crop images encoded together on the vision thread (`RunnerConfig.vision_image_batches`):
images queued behind a running encoding go in one image step, and every request's output is the
reference's."""

from __future__ import annotations

import asyncio
import threading
import time
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


@pytest.fixture(scope="module")
def setup() -> Iterator[tuple[InferenceEngine, ReferenceMoondream]]:
    model = random_model(tiny_config("md2", vision_layers=2), dtype=jnp.float32, seed=13)
    tok = Tokenizer(build_synthetic_tokenizer(model.cfg.text.vocab_size))
    cfg = EngineConfig(runner=RunnerConfig(num_pages=64, kv_dtype="f32", max_seq_len=1024, vision_buckets=(1,),
                                           vision_image_batches=(2, 3)),
                       # decode_steps=4: the multi-step variant test_decode_steps_to_finish.py compiles too
                       decode_buckets=(1, 4), prefill_token_buckets=(1024,), max_prefill_seqs=2, decode_steps=4,
                       vision_ahead=4,
                       vision_batch_wait_ms=0.0)  # encode at once what is queued (the wait: test_encode_ahead)
    eng = asyncio.run(InferenceEngine.create(cfg, model=model, tokenizer=tok))
    yield eng, ReferenceMoondream(model, tok)
    asyncio.run(eng.shutdown())


def test_queued_images_are_encoded_in_one_step_and_outputs_equal_the_reference(
        setup: tuple[InferenceEngine, ReferenceMoondream]) -> None:
    eng, ref = setup
    worker = eng._worker
    ahead, runner = worker._ahead, worker.runner
    assert ahead is not None and "vision_images3" in worker.compile_s
    imgs = [np.random.default_rng(40 + i).integers(0, 255, (300, 340, 3), dtype=np.uint8) for i in range(4)]
    single = runner.encode_image
    entered = threading.Event()

    # The engine thread launches the first image's prefill at once and waits there for its
    # encoding, so the other three wait in its inbox until the first image is encoded; `held`
    # keeps it from being encoded until they are all there (the engine thread then admits all
    # three in one drain). And the vision thread must not start on the first of them before the
    # other two are queued: a long batch wait makes it wait for a full batch or for the engine
    # thread to ask for one, which comes after the three admissions. (The hold used to wait for
    # all four to be *started*, which cannot happen while the engine thread waits: it ended at its
    # 20 s timeout, and under load the three reached the vision thread apart: {1: 2, 2: 1}. So did
    # the urgent admissions (EngineConfig.admit_before_wait) while each was asked for as it was
    # admitted: the thread could start on the first before the next was queued; a drain now asks
    # for them together, EncodeAhead.admitting.)
    def held(*args: object, **kw: object) -> object:
        entered.set()
        t0 = time.monotonic()
        while worker._inbox.qsize() < 3 and time.monotonic() - t0 < 20:
            time.sleep(0.01)
        return single(*args, **kw)

    runner.encode_image = held
    wait_s, ahead._max_wait_s = ahead._max_wait_s, 10.0
    calls = dict(ahead.calls)

    async def run() -> list[Result]:
        def query(img: np.ndarray) -> Any:
            return eng.query(img, "What is this?", reasoning=False, settings={"temperature": 0.0, "max_tokens": 4})

        # the first alone, so that the vision thread starts on it by itself; the rest once it has
        first = asyncio.ensure_future(query(imgs[0]))
        t0 = time.monotonic()
        while not entered.is_set() and time.monotonic() - t0 < 20:
            await asyncio.sleep(0.01)
        rs = await asyncio.gather(first, *[query(img) for img in imgs[1:]])
        return [r for r in rs if isinstance(r, Result)]

    try:
        got = asyncio.run(run())
    finally:
        del runner.encode_image
        ahead._max_wait_s = wait_s
    new = {k: v - calls.get(k, 0) for k, v in ahead.calls.items() if v != calls.get(k, 0)}
    assert new == {1: 1, 3: 1}  # the first alone, the three queued behind it together
    assert eng.stats["encode_ahead"]["calls_by_images"] == dict(sorted(ahead.calls.items()))
    s = SamplingSettings(temperature=0.0, max_tokens=4)
    assert [r.output["answer"] for r in got] == [ref.query(img, "What is this?", reasoning=False, settings=s).output
                                                 for img in imgs]
    assert ahead.pending == 0 and ahead.waiting == 0
