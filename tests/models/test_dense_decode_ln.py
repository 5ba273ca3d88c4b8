"""KESTREL_JAX_DENSE_DECODE_LN=1: decode steps form a dense block's LayerNorm in the residual +
LayerNorm kernel's launch (`ops.residual_layer_norm` with no addends, interpreted here) instead of
XLA's two. Each dense block's LayerNorm (and an MoE block's, where the MoE LayerNorm kernel does
not take it) goes through it once per trace of a decode step; the steps' outputs are those of the jnp path
within bf16 rounding (the kernel reduces the statistics in another order), the sampled tokens
equal; with the switch off nothing goes through it at decode."""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kestrel_jax.models.config import tiny_config
from kestrel_jax.models.moondream import random_model
from kestrel_jax.pallas import layer_norm_blocks as L
from kestrel_jax.pallas import ops
from kestrel_jax.serving import batch as bt
from kestrel_jax.serving.runner import Runner, RunnerConfig

PAGE = 16
ROWS = 2  # the decode bucket below; the prefill step has 32 token rows


def _steps(family: Literal["md2", "md3"]) -> list[np.ndarray]:
    """A prefill of two sequences, then three 2-row decode steps: outputs and the KV pool."""
    model = random_model(tiny_config(family, vision_layers=2), dtype=jnp.bfloat16, seed=5)
    r = Runner(model, RunnerConfig(num_pages=16, kv_dtype="bf16", max_seq_len=128, page_size=PAGE,
                                   vision_buckets=(2,)), out_rows=8)
    p = r.max_pages_per_seq
    a, b = [1, 700, 33, 4000, 12, 9, 81, 5], [1, 55, 66, 77, 88]
    pre = bt.text_prefill([(2, a), (6, b)], tokens=32, max_seqs=2, pages=p, page_size=PAGE)
    out = [np.asarray(r.prefill(*pre, jnp.zeros((1, 728, model.cfg.text.dim), model.dtype)))]
    rows = [[2, len(a), int(out[0][0, 0])], [6, len(b), int(out[0][1, 0])]]
    for _ in range(3):
        dec = bt.text_decode([(s, n, tok, -1) for s, n, tok in rows], bucket=ROWS, pages=p, page_size=PAGE)
        out.append(np.asarray(r.decode(*dec, None)[1]))
        for j, row in enumerate(rows):
            row[1], row[2] = row[1] + 1, int(out[-1][j, 0])
    return out + [np.asarray(x.astype(jnp.float32)) for x in (*r.cache.k, *r.cache.v)]


def _record(monkeypatch: pytest.MonkeyPatch) -> tuple[list[tuple[int, int]], list[int]]:
    """(rows, addends) of every `ops.residual_layer_norm` call traced, and the rows of each kernel
    run: the decode-sized calls run the kernel, interpreted."""
    calls: list[tuple[int, int]] = []
    runs: list[int] = []
    original = ops.residual_layer_norm

    def interpreted(fn: Any, static: tuple[str, ...] = ()) -> Any:
        def run(x: jax.Array, *args: Any, **kwargs: Any) -> Any:
            runs.append(x.shape[0])
            return fn(x, *args, interpret=True, **kwargs)
        return run

    def recorded(x: jax.Array, adds: tuple[jax.Array, ...], *args: Any, **kwargs: Any) -> Any:
        calls.append((x.shape[0], len(adds)))
        if x.shape[0] != ROWS:
            return original(x, adds, *args, **kwargs)
        with ops.use_backend("kernel"), monkeypatch.context() as m:
            m.setattr(ops, "_jitted", interpreted)
            return original(x, adds, *args, **kwargs)

    monkeypatch.setattr(ops, "residual_layer_norm", recorded)
    return calls, runs


@pytest.mark.parametrize("family", ["md2", "md3"])
def test_dense_decode_layer_norms_in_the_kernel(family: Literal["md2", "md3"], monkeypatch: pytest.MonkeyPatch):
    calls, runs = _record(monkeypatch)
    ref = _steps(family)
    assert not [c for c in calls if c[0] == ROWS] and not runs, "off by default: decode keeps XLA's LayerNorm"
    calls.clear()
    monkeypatch.setenv("KESTREL_JAX_DENSE_DECODE_LN", "1")
    got = _steps(family)
    decode = [c for c in calls if c[0] == ROWS]
    # per decode trace: tiny MD2's four dense blocks' LayerNorms; tiny MD3's two dense blocks' (the
    # first MoE block's LayerNorm is the MoE LayerNorm kernel's, up to the QKV kernel's rows)
    per_trace = 4 if family == "md2" else 2
    assert decode and len(decode) % per_trace == 0 and set(decode) == {(ROWS, 0)}, decode
    assert runs == [ROWS] * len(decode)  # each of them in the kernel
    for x, y in zip(got[:4], ref[:4], strict=True):
        np.testing.assert_array_equal(x[:, 0], y[:, 0])  # sampled tokens
        np.testing.assert_allclose(x, y, rtol=2.0**-6, atol=2.0**-6 * np.abs(y).max())
    for x, y in zip(got[4:], ref[4:], strict=True):
        np.testing.assert_allclose(x, y, rtol=2.0**-6, atol=2.0**-6 * np.abs(y).max())


def test_dense_decode_layer_norm_lowers_at_decode_shapes():
    """The kernel (no addends) at MD2 / MD3 decode shapes, 1 and 64 rows, for the GPU."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    sds = jax.ShapeDtypeStruct
    for T in (1, 64):
        def f(x, s, b):
            return L.residual_layer_norm_blocks_kernel(x, (), s, b, eps=1e-5, block_rows=L.default_block_rows(2048))

        with jax.sharding.use_abstract_mesh(mesh):
            text = jax.jit(f).trace(sds((T, 2048), jnp.bfloat16), sds((2048,), jnp.bfloat16),
                                    sds((2048,), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
        assert "kestrel_residual_layer_norm_blocks" in text
