"""The region heads' gate end to end (KESTREL_JAX_REGION_GATE=1): the engine's steps carry the
host's "any row needs the region heads" column (batch.D_REGION / T_REGION) to the heads' decode
GEMMs, which skip their products where it is 0. On the CPU those GEMMs are jnp products, so the
gate is applied here by a stand-in for the decode GEMM entry points (a gated product is zero, as
the kernel's): detect, point and reasoning outputs must still be the reference's (their steps keep
the heads) and text answers too (their steps may drop them), and text-only steps must really run
gated off."""

from __future__ import annotations

import asyncio
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kestrel_jax.generate import SamplingSettings
from kestrel_jax.pallas import ops
from kestrel_jax.reference import ReferenceMoondream
from kestrel_jax.serving.engine import EngineConfig, InferenceEngine, Result
from kestrel_jax.serving.runner import RunnerConfig

_GATES: list[int] = []  # the gate element each gated product saw, at run time


def _gated(x, w, b, gate):
    on = gate.table[gate.row, gate.column]
    jax.debug.callback(lambda v: _GATES.append(int(v)), on)
    y = jnp.where(on != 0, jnp.dot(x, w.astype(x.dtype)), 0.0).astype(x.dtype)
    return y if b is None else y + b.astype(x.dtype)


def test_gated_region_heads_keep_every_output(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def small_linear(x, w, b, *, max_rows, rows=None, gate=None, splits=None, stages=4, row_major=False):
        if gate is None or (rows or x.shape[0]) > max_rows:
            return None  # as on the CPU without the gate: the caller's jnp product
        return _gated(x[:rows] if rows else x, w, b, gate)

    def small_linear_pair(x, w1, b1, w2, b2, *, max_rows, rows=None, padded_ok=False, tau=None, gate=None):
        if gate is None or (rows or x.shape[0]) > max_rows:
            return None
        return _gated(x, w1, b1, gate), _gated(x, w2, b2, gate), None

    monkeypatch.setattr(ops, "small_linear", small_linear)
    monkeypatch.setattr(ops, "small_linear_pair", small_linear_pair)
    monkeypatch.setenv("KESTREL_JAX_REGION_GATE", "1")
    cfg = EngineConfig(model_path=str(ckpt), dtype="float32",
                       runner=RunnerConfig(num_pages=64, kv_dtype="f32", max_seq_len=1024, page_size=64,
                                           vision_buckets=(1,)),
                       # one decode bucket: the gate does not depend on the bucket a batch pads to, and
                       # each bucket costs two compiled decode variants (one and several iterations)
                       decode_buckets=(4,), prefill_token_buckets=(1024,), max_prefill_seqs=4)
    engine = asyncio.run(InferenceEngine.create(cfg))
    ref = ReferenceMoondream.from_checkpoint(ckpt, dtype=jnp.float32, progress=False)
    img = np.random.default_rng(4).integers(0, 255, (378, 378, 3), dtype=np.uint8)  # one crop
    greedy = SamplingSettings(temperature=0.0, max_tokens=3)
    try:
        _GATES.clear()
        alone = asyncio.run(engine.query(None, "Hello", reasoning=False, settings={"temperature": 0.0,
                                                                                    "max_tokens": 3}))
        jax.effects_barrier()
        assert _GATES and not any(_GATES), "a text-only request's steps run the heads gated off"

        async def run() -> list[Result]:
            rs = await asyncio.gather(
                engine.detect(img, "car", settings={"max_objects": 2}),
                engine.point(img, "sun", settings={"max_objects": 2}),
                engine.query(img, "How many?", reasoning=True, settings={"temperature": 0.0, "max_tokens": 3}),
                engine.query(img, "What?", reasoning=False, settings={"temperature": 0.0, "max_tokens": 3}))
            return [r for r in rs if isinstance(r, Result)]

        det, pt, rsn, ans = asyncio.run(run())
        jax.effects_barrier()
        assert any(_GATES)
    finally:
        asyncio.run(engine.shutdown())
    assert isinstance(alone, Result) and alone.output["answer"] == ref.query(None, "Hello", reasoning=False,
                                                                             settings=greedy).output
    want = ref.detect(img, "car", max_objects=2).output
    np.testing.assert_allclose([[o[k] for k in o] for o in det.output["objects"]], [[o[k] for k in o] for o in want],
                               atol=1e-6)
    np.testing.assert_allclose([[o["x"], o["y"]] for o in pt.output["points"]],
                               [[o["x"], o["y"]] for o in ref.point(img, "sun", max_objects=2).output], atol=1e-6)
    r = ref.query(img, "How many?", reasoning=True, settings=greedy)
    assert rsn.output["answer"] == r.output and rsn.output["reasoning"]["text"] == r.extra["reasoning"]["text"]
    assert ans.output["answer"] == ref.query(img, "What?", reasoning=False, settings=greedy).output
