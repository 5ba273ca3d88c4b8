"""Text decode steps (`RunnerConfig.text_steps`): a multi-step launch whose rows need no region
heads (batch.D_REGION 0) runs a step compiled without the region encoders, heads, argmaxes and
continuation decision. Its sampled tokens, log-probabilities and KV writes must be the full step's
bit for bit, its region columns zero; every other launch keeps the full step, and the engine
compiles the text step beside the full one only where a model's segment rows need the latter."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Literal

import jax.numpy as jnp
import numpy as np
import pytest

from kestrel_jax.models.config import tiny_config
from kestrel_jax.models.moondream import MoondreamModel, random_model
from kestrel_jax.serving import batch as bt
from kestrel_jax.serving.engine import EngineConfig
from kestrel_jax.serving.loop import EngineWorker
from kestrel_jax.serving.runner import Runner, RunnerConfig

PAGE = 16
LAYERS = {"md2": 2, "md3": 3}  # MD3: two dense layers and one MoE layer


@pytest.fixture(scope="module", params=["md3", "md2"])
def model(request: pytest.FixtureRequest) -> MoondreamModel:
    cfg = tiny_config(request.param, vision_layers=2)
    cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, n_layers=LAYERS[request.param])).validate()
    return random_model(cfg, dtype=jnp.float32, seed=5)


def _runner(model: MoondreamModel, text_steps: bool) -> Runner:
    cfg = RunnerConfig(num_pages=16, kv_dtype="f32", max_seq_len=128, page_size=PAGE, vision_buckets=(2,),
                       text_steps=text_steps)
    return Runner(model, cfg, out_rows=8)


def _kv(runner: Runner, pages: list[int]) -> np.ndarray:
    return np.stack([np.asarray(k[np.array(pages)]) for k in (*runner.cache.k, *runner.cache.v)])


def test_text_step_equals_the_full_step(model: MoondreamModel) -> None:
    """Two text rows (one greedy, one sampled at temperature 0.7 with top-p) prefilled, then one
    4-iteration launch fed from the prefill's outputs on the device: the text step's tokens,
    log-probabilities, feed row and KV pages equal the full step's exactly."""
    a, b = [1, 700, 33, 4000, 12, 9, 81, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [1, 55, 66, 77, 88]
    steps = 4
    got = {}
    for text_steps in (False, True):
        runner = _runner(model, text_steps)
        pages = runner.max_pages_per_seq
        specs = tuple(bt.RowSpec(temperature=t, seed=100 + i) for i, t in enumerate((0.0, 0.9)))
        pre = bt.text_prefill([(2, a), (6, b)], tokens=32, max_seqs=2, pages=pages, page_size=PAGE, specs=specs)
        first = runner.prefill(*pre, jnp.zeros((1, 728, model.cfg.text.dim)))
        specs = tuple(bt.RowSpec(temperature=t, top_p=0.9, seed=7 + i, step=1) for i, t in enumerate((0.0, 0.7)))
        ints, floats = bt.text_decode([(2, len(a), -1, 0), (6, len(b), -1, 1)], bucket=2, pages=pages,
                                      page_size=PAGE, specs=specs)
        ints[:2, bt.D_NSTEPS] = steps
        assert ints[0, bt.D_REGION] == 0  # text rows
        assert runner.decode_region(ints, steps) is not text_steps
        outs, last = runner.decode(ints, floats, first, steps)
        assert set(runner._decode) == {(steps, not text_steps)}
        got[text_steps] = np.asarray(outs), np.asarray(last), _kv(runner, [2, 3, 6])
    (o_full, l_full, kv_full), (o_text, l_text, kv_text) = got[False], got[True]
    assert o_text.shape == o_full.shape == (steps, 8, 6)
    np.testing.assert_array_equal(o_text[:, :2, :2], o_full[:, :2, :2])  # tokens, log-probabilities
    np.testing.assert_array_equal(l_text[:2, :2], l_full[:2, :2])
    assert not o_text[:, :, 2:].any()  # no coordinate, size or continuation decision
    assert o_full[:, :2, 2:].any()  # (the full step's: some non-zero values)
    np.testing.assert_array_equal(kv_text, kv_full)
    assert np.abs(kv_text).sum() > 0


def test_only_multi_step_text_launches_take_the_text_step(model: MoondreamModel) -> None:
    runner = _runner(model, True)
    ints, _ = bt.text_decode([(2, 5, 3, -1)], bucket=1, pages=runner.max_pages_per_seq, page_size=PAGE)
    assert runner.decode_region(ints, 1)  # one iteration: always the full step
    assert not runner.decode_region(ints, 8)
    region = ints.copy()
    bt.decode_row(region, np.zeros((1, bt.DF), np.float32), 0, kind=bt.IN_TOKEN, token=3, value=(0.0, 0.0), src=-1,
                  spec=bt.RowSpec(segment=True), steps=8)
    bt.mark_region(region)
    assert runner.decode_region(region, 8)  # a segment row feeds decoded coordinates and sizes
    assert _runner(model, False).decode_region(ints, 8)  # text_steps off


@pytest.mark.parametrize("name", ["md2", "md3"])
@pytest.mark.parametrize("text_steps", [True, False])
def test_the_engine_compiles_the_text_step_where_it_runs(name: Literal["md2", "md3"], text_steps: bool) -> None:
    """Per decode bucket: one iteration with the heads; multi-step buckets the text step, and the
    full multi-step only for a model with the segment skill (MD3); with text_steps off, as before."""
    cfg = tiny_config(name)
    engine = EngineConfig(decode_buckets=(1, 4, 64, 128), decode_steps=8, multi_step_max_batch=64)
    worker = SimpleNamespace(config=engine,
                             runner=SimpleNamespace(config=RunnerConfig(text_steps=text_steps)),
                             model=SimpleNamespace(cfg=cfg))
    variants = {b: EngineWorker._step_variants(worker, b) for b in (1, 64, 128)}  # type: ignore[arg-type]
    multi = ((8, False), (8, True)) if name == "md3" else ((8, False),)
    if not text_steps:
        multi = ((8, True),)
    assert variants == {1: ((1, True), *multi), 64: ((1, True), *multi), 128: ((1, True),)}  # 128: over 64 rows
