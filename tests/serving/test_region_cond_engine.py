"""The region heads under a `lax.cond` (KESTREL_JAX_REGION_COND=1): the engine's steps run the
region encoders, heads, argmaxes and the continuation decision only where the host's "any row
needs the region heads" column (batch.D_REGION / T_REGION) is set. Detect, point and reasoning
outputs must still be the reference's, text answers too, and a text-only request's steps must
really skip the branch (a callback inside it counts the steps that ran it)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kestrel_jax.generate import SamplingSettings
from kestrel_jax.reference import ReferenceMoondream
from kestrel_jax.serving import runner as runner_mod
from kestrel_jax.serving.engine import EngineConfig, InferenceEngine, Result
from kestrel_jax.serving.runner import RunnerConfig

_RAN: list[int] = []  # one entry per step that ran the region branch


def test_region_cond_keeps_every_output_and_skips_text_steps(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = runner_mod.coord_bin_to_value

    def counted(bins: jax.Array) -> jax.Array:  # only traced inside `_heads`' region branch
        jax.debug.callback(lambda: _RAN.append(1))
        return real(bins)

    monkeypatch.setattr(runner_mod, "coord_bin_to_value", counted)
    monkeypatch.setenv("KESTREL_JAX_REGION_COND", "1")
    cfg = EngineConfig(model_path=str(ckpt), dtype="float32",
                       runner=RunnerConfig(num_pages=64, kv_dtype="f32", max_seq_len=1024, page_size=64,
                                           vision_buckets=(1,)),
                       decode_buckets=(4,), prefill_token_buckets=(1024,), max_prefill_seqs=4)
    engine = asyncio.run(InferenceEngine.create(cfg))
    ref = ReferenceMoondream.from_checkpoint(ckpt, dtype=jnp.float32, progress=False)
    img = np.random.default_rng(4).integers(0, 255, (378, 378, 3), dtype=np.uint8)  # one crop
    greedy = SamplingSettings(temperature=0.0, max_tokens=3)
    try:
        jax.effects_barrier()
        _RAN.clear()  # (start-up runs no step, but be sure)
        alone = asyncio.run(engine.query(None, "Hello", reasoning=False, settings={"temperature": 0.0,
                                                                                    "max_tokens": 3}))
        jax.effects_barrier()
        assert not _RAN, "a text-only request's steps skip the region branch"

        async def run() -> list[Result]:
            rs = await asyncio.gather(
                engine.detect(img, "car", settings={"max_objects": 2}),
                engine.point(img, "sun", settings={"max_objects": 2}),
                engine.query(img, "How many?", reasoning=True, settings={"temperature": 0.0, "max_tokens": 3}),
                engine.query(img, "What?", reasoning=False, settings={"temperature": 0.0, "max_tokens": 3}))
            return [r for r in rs if isinstance(r, Result)]

        det, pt, rsn, ans = asyncio.run(run())
        jax.effects_barrier()
        assert _RAN, "region steps run the branch"
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
