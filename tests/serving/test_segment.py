"""The segment skill on the engine against the reference path (MOONDREAM.md §7.6).

A random model almost never samples the coordinate or size token, so this one's lm_head bias
makes them likely (about a quarter of the samples at temperature 1, every greedy one): the engine
must feed E_coord / E_size of the value decoded from the hidden state that sampled each, on the
host after a prefill and on the device in pipelined and multi-step decode launches, or the
samples after it differ from the reference path's."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from kestrel_jax.generate import SamplingSettings
from kestrel_jax.models.config import tiny_config
from kestrel_jax.models.moondream import random_model
from kestrel_jax.prompts import PromptError
from kestrel_jax.reference import ReferenceMoondream
from kestrel_jax.serving.engine import EngineConfig, InferenceEngine, Result
from kestrel_jax.serving.plan import DecodePlan
from kestrel_jax.serving.runner import RunnerConfig
from kestrel_jax.serving.skills import SettingsError
from kestrel_jax.tokenizer import Tokenizer, build_synthetic_tokenizer


@pytest.fixture(scope="module")
def setup() -> Iterator[tuple[InferenceEngine, ReferenceMoondream, list[tuple[int, int]]]]:
    model = random_model(tiny_config("md3", vision_layers=2), dtype=jnp.float32, seed=21)
    b = model.text.lm_head.bias
    assert b is not None
    cfg = model.cfg
    b.set_value(b[...].at[cfg.tokenizer.coord_id].set(7.0).at[cfg.tokenizer.size_id].set(7.0))
    tok = Tokenizer(build_synthetic_tokenizer(cfg.text.vocab_size))
    ecfg = EngineConfig(runner=RunnerConfig(num_pages=64, kv_dtype="f32", max_seq_len=1024, vision_buckets=(1,)),
                        decode_buckets=(1, 4), prefill_token_buckets=(1024,), max_prefill_seqs=2, decode_steps=4)
    eng = asyncio.run(InferenceEngine.create(ecfg, model=model, tokenizer=tok))
    plans: list[tuple[int, int]] = []  # decode launches: (iterations, rows)
    sched = eng._worker.scheduler
    real = sched.schedule

    def spy(*args: Any, **kw: Any) -> Any:
        plan = real(*args, **kw)
        if isinstance(plan, DecodePlan):
            plans.append((plan.steps, plan.num_seqs))
        return plan

    sched.schedule = spy
    yield eng, ReferenceMoondream(model, tok), plans
    asyncio.run(eng.shutdown())


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return bool(a == pytest.approx(b, rel=1e-6, abs=1e-7))
    return bool(a == b)


def test_segment_outputs_equal_the_reference(
        setup: tuple[InferenceEngine, ReferenceMoondream, list[tuple[int, int]]]) -> None:
    eng, ref, plans = setup
    img = np.random.default_rng(0).integers(0, 255, (378, 378, 3), dtype=np.uint8)
    asks: list[tuple[str, dict[str, Any], tuple[Any, ...]]] = [
        ("dog", {"temperature": 1.0, "seed": 3, "max_tokens": 24}, ()),
        ("cat", {"temperature": 1.0, "seed": 4, "max_tokens": 24}, ((0.2, 0.3, 0.6, 0.9),)),
        ("red car", {"temperature": 1.0, "top_p": 0.9, "seed": 5, "max_tokens": 17}, ()),
        ("tree", {"max_tokens": 9}, ((0.5, 0.5),)),  # greedy (the default): every sample a coordinate or size
    ]

    async def run() -> list[Result]:
        rs = await asyncio.gather(*(eng.segment(img, obj, settings=s, spatial_refs=refs) for obj, s, refs in asks))
        return [r for r in rs if isinstance(r, Result)]

    plans.clear()
    got = asyncio.run(run())
    assert len(got) == len(asks)
    kinds = {"coord": 0, "size": 0, "text": 0}
    for r, (obj, s, refs) in zip(got, asks, strict=True):
        want = ref.segment(img, obj, settings=SamplingSettings(**{"temperature": 0.0, "top_p": 1.0, **s}),
                           spatial_refs=refs)
        (g,), (w,) = r.output["segments"], want.output["segments"]
        # sizes (and the box from them) are 2^(10 bin / 1023 - 10) of the same bins, evaluated in
        # the engine's step and eagerly here: equal to float32 rounding
        inexact = ("bbox", "coarse_bbox", "sizes")
        assert {k: v for k, v in g.items() if k not in inexact} == {k: v for k, v in w.items() if k not in inexact}
        assert g.keys() == w.keys()
        for k in inexact:
            assert _close(g.get(k), w.get(k)), (obj, k, g.get(k), w.get(k))
        assert r.finish_reason == want.finish_reason == "length"
        seg = r.output["segments"][0]
        assert seg["object"] == obj
        kinds["coord"] += 2 * len(seg["points"])
        kinds["size"] += len(seg.get("sizes", []))
        kinds["text"] += len(seg["token_ids"])
        assert r.metrics.output_tokens == s["max_tokens"]
    assert all(v > 3 for v in kinds.values()), kinds  # each path taken, several times
    assert any(k > 1 for k, _ in plans), plans  # multi-step launches ran segment rows ahead
    eng._worker.scheduler.check_invariants()
    assert eng.stats["live"] == 0


def test_bad_segment_requests_fail_alone(
        setup: tuple[InferenceEngine, ReferenceMoondream, list[tuple[int, int]]]) -> None:
    eng, _, _ = setup
    img = np.zeros((64, 64, 3), np.uint8)

    async def run() -> None:
        with pytest.raises(PromptError, match="object"):
            await eng.segment(img, "   ")
        with pytest.raises(SettingsError, match="does not fit the context"):
            await eng.segment(img, "dog", settings={"max_tokens": 768})  # 1024-token engine
        with pytest.raises(SettingsError, match="top_p"):
            await eng.segment(img, "dog", settings={"top_p": 0.0})
        r = await eng.segment(img, "dog", settings={"max_tokens": 3})
        assert isinstance(r, Result) and r.metrics.output_tokens == 3

    asyncio.run(run())


def test_point_with_spatial_refs_equals_the_reference(
        setup: tuple[InferenceEngine, ReferenceMoondream, list[tuple[int, int]]]) -> None:
    """Point takes spatial references as Kestrel's does: prefix + refs + object + suffix. Its
    prefill feeds E_coord / E_size of the references' values at their slots (a random model's
    points hardly move with them, so the step's inputs are checked, then the output)."""
    from kestrel_jax.serving import batch as bt

    eng, ref, _ = setup
    img = np.random.default_rng(1).integers(0, 255, (378, 378, 3), dtype=np.uint8)
    refs = ((0.25, 0.5), (0.1, 0.1, 0.4, 0.3))
    runner = eng._worker.runner
    fed: list[tuple[np.ndarray, np.ndarray]] = []
    prefill = runner.prefill

    def spy(tok_ints: np.ndarray, tok_floats: np.ndarray, *args: Any) -> Any:
        fed.append((tok_ints.copy(), tok_floats.copy()))
        return prefill(tok_ints, tok_floats, *args)

    async def run() -> Any:
        return await eng.point(img, "sun", spatial_refs=refs, settings={"max_objects": 3})

    runner.prefill = spy
    try:
        got = asyncio.run(run())
    finally:
        del runner.prefill
    (ints, floats), = fed  # one prefill step, nothing else running
    coord = ints[:, bt.T_KIND] == bt.IN_COORD
    size = ints[:, bt.T_KIND] == bt.IN_SIZE
    np.testing.assert_allclose(floats[coord, 0], [0.25, 0.5, 0.25, 0.2], rtol=1e-6)
    np.testing.assert_allclose(floats[size], [[0.3, 0.2]], rtol=1e-6)
    want = ref.point(img, "sun", max_objects=3, spatial_refs=refs)
    assert got.output["points"] == want.output and len(want.output) == 3
