"""Engine paths a random model rarely takes, forced through the lm_head bias: reasoning that
samples coordinate tokens (grounding: E_coord fed from the same hidden state), reasoning that
samples the answer token (the answer phase starts on the device in the pipelined loop), and
cancellation. Each must give exactly the reference path's outputs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import jax.numpy as jnp
import numpy as np
import pytest

from kestrel_jax.generate import SamplingSettings
from kestrel_jax.models.config import tiny_config
from kestrel_jax.models.moondream import MoondreamModel, random_model
from kestrel_jax.reference import ReferenceMoondream
from kestrel_jax.serving.engine import EngineConfig, InferenceEngine, Result
from kestrel_jax.serving.runner import RunnerConfig
from kestrel_jax.tokenizer import Tokenizer, build_synthetic_tokenizer


def _biased(token: int, bias: float) -> MoondreamModel:
    model = random_model(tiny_config("md2", vision_layers=2), dtype=jnp.float32, seed=3)
    b = model.text.lm_head.bias
    assert b is not None
    b.set_value(b[...].at[token].set(bias))
    return model


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One compile cache for both engines below: they differ in a weight, not in any step's shape,
    so the second loads the first's exported and compiled steps (and the export files of two
    models are checked to serve each other)."""
    return str(tmp_path_factory.mktemp("compile"))


@pytest.fixture(scope="module", params=[(5, 12.0), (3, 12.0)], ids=["coord-in-reasoning", "answer-in-reasoning"])
def setup(request: pytest.FixtureRequest, compile_cache: str) -> Iterator[tuple[InferenceEngine, ReferenceMoondream]]:
    token, bias = request.param
    model = _biased(token, bias)
    tok = Tokenizer(build_synthetic_tokenizer(model.cfg.text.vocab_size))
    # vision bucket 1: a 378 px image (1x1 tiling) encodes its one distinct crop once (host crops)
    cfg = EngineConfig(runner=RunnerConfig(num_pages=64, kv_dtype="f32", max_seq_len=1024, vision_buckets=(1,),
                                           compilation_cache_dir=compile_cache),
                       # one decode bucket (at most two rows decode here at a time): each exported step compiles
                       decode_buckets=(4,), prefill_token_buckets=(1024,), max_prefill_seqs=2)
    eng = asyncio.run(InferenceEngine.create(cfg, model=model, tokenizer=tok))
    if request.param == (3, 12.0):  # the second engine: every step from the first one's exports
        assert eng.stats["export"]["loaded"] > 0 and eng.stats["export"]["exported"] == 0, eng.stats["export"]
    yield eng, ReferenceMoondream(model, tok)
    asyncio.run(eng.shutdown())


def test_reasoning_paths_match_reference(setup: tuple[InferenceEngine, ReferenceMoondream]) -> None:
    eng, ref = setup
    img = np.random.default_rng(0).integers(0, 255, (378, 378, 3), dtype=np.uint8)

    async def run() -> list[Result]:
        rs = await asyncio.gather(*(eng.query(img, q, reasoning=True, settings={"temperature": 0.0,
                                                                               "max_tokens": 5})
                                    for q in ("Where is it?", "Count them")))
        return [r for r in rs if isinstance(r, Result)]

    got = asyncio.run(run())
    for r, q in zip(got, ("Where is it?", "Count them"), strict=True):
        want = ref.query(img, q, reasoning=True, settings=SamplingSettings(temperature=0.0, max_tokens=5))
        assert r.output["answer"] == want.output
        assert r.output["reasoning"]["text"] == want.extra["reasoning"]["text"]
        got_g = [(g["index"], round(g["value"], 6)) for g in r.output["reasoning"]["grounding"]]
        want_g = [(g["index"], round(g["value"], 6)) for g in want.extra["reasoning"]["grounding"]]
        assert got_g == want_g
    eng._worker.scheduler.check_invariants()
    assert eng.stats["live"] == 0
    # device crops default to off on the CPU: this engine covers the host path
    assert eng.stats["images"]["host_crops"] >= 1 and eng.stats["images"]["device_crops"] == 0


def test_cancel_during_prefill_frees_everything(setup: tuple[InferenceEngine, ReferenceMoondream]) -> None:
    eng, _ = setup
    img = np.random.default_rng(1).integers(0, 255, (378, 378, 3), dtype=np.uint8)

    async def run() -> tuple[Result, Result]:
        stream = await eng.caption(img, settings={"temperature": 0.0, "max_tokens": 200, "ignore_eos": True},
                                   stream=True)
        other = asyncio.ensure_future(eng.caption(img, settings={"temperature": 0.0, "max_tokens": 3}))
        await asyncio.sleep(0.2)  # the image prefill takes seconds on a CPU
        eng.cancel(stream.request_id)
        async for _ in stream:  # type: ignore[union-attr]
            pass
        return await stream.result(), await other  # type: ignore[union-attr,return-value]

    res, other = asyncio.run(run())
    assert res.finish_reason == "cancelled"
    assert res.metrics.output_tokens < 200
    assert other.finish_reason == "length" and other.metrics.output_tokens == 3  # unaffected
    eng._worker.scheduler.check_invariants()
    assert eng.stats["live"] == 0
