"""EngineConfig.defer_unready_images: a prefill whose image encoding (on the vision thread) is not
done is held back and the engine thread keeps launching decode steps for the others instead of
waiting for the encoding; the held-back request then prefills and answers as the reference does."""

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


@pytest.fixture(scope="module", params=[True, False], ids=["defer", "wait"])
def setup(request: pytest.FixtureRequest) -> Iterator[tuple[InferenceEngine, ReferenceMoondream, bool]]:
    model = random_model(tiny_config("md2", vision_layers=2), dtype=jnp.float32, seed=11)
    tok = Tokenizer(build_synthetic_tokenizer(model.cfg.text.vocab_size))
    cfg = EngineConfig(runner=RunnerConfig(num_pages=64, kv_dtype="f32", max_seq_len=1024, vision_buckets=(2,)),
                       decode_buckets=(1, 4), prefill_token_buckets=(1024,), max_prefill_seqs=2, decode_steps=1,
                       vision_thread=True, defer_unready_images=request.param)
    eng = asyncio.run(InferenceEngine.create(cfg, model=model, tokenizer=tok))
    yield eng, ReferenceMoondream(model, tok), request.param
    asyncio.run(eng.shutdown())


def test_decoding_goes_on_while_an_image_encodes(setup: tuple[InferenceEngine, ReferenceMoondream, bool]) -> None:
    eng, ref, defer = setup
    runner = eng._worker.runner
    encode, gate, entered = runner.encode_image, threading.Event(), threading.Event()

    def gated(*args: object) -> object:
        entered.set()
        assert gate.wait(60)
        return encode(*args)

    runner.encode_image = gated
    img = np.random.default_rng(5).integers(0, 255, (300, 340, 3), dtype=np.uint8)
    text_settings = {"temperature": 0.0, "max_tokens": 200}  # still decoding through the gated second
    iterations = 0

    async def run() -> tuple[object, object]:
        nonlocal iterations
        text = asyncio.create_task(eng.query(None, "Tell me a story.", reasoning=False, settings=text_settings))
        while eng.stats["steps"]["decode_iterations"] == 0:  # the text request decodes
            await asyncio.sleep(0.01)
        image = asyncio.create_task(eng.query(img, "What is this?", reasoning=False,
                                              settings={"temperature": 0.0, "max_tokens": 4}))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        start = eng.stats["steps"]["decode_iterations"]
        await asyncio.sleep(1.0)  # the encoding is held: does the text request still decode?
        iterations = eng.stats["steps"]["decode_iterations"] - start
        gate.set()
        return await text, await image

    try:
        t, i = asyncio.run(run())
    finally:
        gate.set()
        del runner.encode_image
    assert isinstance(t, Result) and isinstance(i, Result)
    deferred = eng.stats["scheduler"].deferred_prefills
    if defer:
        assert iterations > 0 and deferred > 0, (iterations, deferred)
    else:  # the engine thread waits in the prefill's launch: nothing decodes meanwhile
        assert iterations == 0 and deferred == 0, (iterations, deferred)
    s = SamplingSettings(temperature=0.0, max_tokens=4)
    assert i.output["answer"] == ref.query(img, "What is this?", reasoning=False, settings=s).output
    s200 = SamplingSettings(temperature=0.0, max_tokens=200)
    assert t.output["answer"] == ref.query(None, "Tell me a story.", reasoning=False, settings=s200).output
    w = eng._worker
    assert w._live == {} and w._ahead is not None and w._ahead.pending == 0
    w.scheduler.check_invariants()
