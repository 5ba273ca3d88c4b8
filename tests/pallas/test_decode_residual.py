"""The decode residual + LayerNorm kernel (Pallas Triton), interpreted on the CPU against
`residual_ln_ref` (the model's unfused jnp expressions), and cross-lowered for an H100.

Bounds: x' is formed with the jnp path's roundings (split sum in order, bias, two rounded residual
adds); the expert-weighted sum runs in choice order in f32 where XLA may reduce in another order,
so an x' value may land one bf16 step away (RTOL 2^-7 of the row's largest value). LN(x') then
follows within the same bound plus its own f32 reduction order. Padding rows of the normalised
output are exactly zero, invalid choices (NaN rows) never leak.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType
from kernel_helpers import as_f32, fresh_rng

from kestrel_jax.pallas import decode_residual as dr

BF16 = jnp.bfloat16
_SDS = jax.ShapeDtypeStruct


def _case(rng, T, D, S, Mp, K, R, bias=True, dtype=BF16):
    x = jnp.asarray(rng.standard_normal((T, D)) * 3.0, dtype)
    parts = np.zeros((S, D, Mp), np.float32)
    parts[:, :, :T] = rng.standard_normal((S, D, T))
    y = rng.standard_normal((R, D)).astype(np.float32)
    P = max(8, T)  # the routing tables' token width: columns >= T are never read
    dest = rng.integers(0, R - K, (K, P)).astype(np.int32)
    n_valid = T
    if T > 1:
        n_valid = T - 1  # a padding token: its rows (no other token's) are NaN and must not leak
        dest[:, T - 1] = np.arange(R - K, R)
        y[R - K:] = np.nan
    w = rng.random((K, P)).astype(np.float32)
    proj = dr.ProjParts(jnp.asarray(parts), jnp.asarray(rng.standard_normal(D) * 0.5, dtype) if bias else None, T)
    moe = dr.ExpertRows(jnp.asarray(y, dtype), jnp.asarray(dest), jnp.asarray(w / w.sum(0, keepdims=True)),
                        jnp.asarray([n_valid], jnp.int32))
    ln = (jnp.asarray(rng.uniform(0.5, 1.5, D), dtype), jnp.asarray(rng.standard_normal(D) * 0.1, dtype))
    return x, proj, moe, ln


def _close(got, want, rtol=2.0**-7):
    got, want = as_f32(got), as_f32(want)
    assert np.isfinite(got).all()
    scale = np.abs(want).max(axis=-1, keepdims=True)
    assert (np.abs(got - want) <= rtol * scale).all(), np.abs(got - want).max()


@pytest.mark.parametrize("T,D,S,Mp,K,R,bias,ln", [
    (1, 1024, 8, 8, 8, 64, True, True),  # MD3 batch 1 shape family (4 column blocks)
    (5, 512, 4, 8, 4, 40, True, True),  # a padding token among five
    (8, 256, 2, 8, 2, 16, False, True),
    (3, 512, 3, 8, 8, 24, True, False),  # last layer: no LayerNorm
])
def test_kernel_matches_the_reference(T, D, S, Mp, K, R, bias, ln):
    rng = fresh_rng()
    x, proj, moe, lnw = _case(rng, T, D, S, Mp, K, R, bias)
    lnw = lnw if ln else None
    got_x, got_n = dr.residual_ln_kernel(x, proj, moe, lnw, eps=1e-5, pad_rows=Mp, interpret=True)
    want_x, want_n = dr.residual_ln_ref(x, proj, moe, lnw, eps=1e-5, pad_rows=Mp)
    assert got_x.shape == (T, D) and got_x.dtype == x.dtype
    _close(got_x, want_x)
    if not ln:
        assert got_n is None and want_n is None
        return
    assert got_n is not None and want_n is not None and got_n.shape == (Mp, D)
    _close(got_n[:T], want_n[:T], rtol=2.0**-5)  # normalised values: |LN| up to ~sqrt(D)
    assert not np.any(as_f32(got_n[T:])), "padding rows must be zero"


def test_reference_is_the_unfused_model_math():
    """(x + a) + m with a the decode GEMM's finished product and m the MoE combine, then the
    LayerNorm module's math: what the model computes without the kernel."""
    rng = fresh_rng()
    x, proj, moe, lnw = _case(rng, 2, 256, 2, 8, 2, 8, True)
    a = dr.finish_proj(proj, x.dtype)
    want_a = (jnp.asarray(as_f32(proj.parts).sum(0).T[:2]).astype(BF16) + proj.bias).astype(BF16)
    np.testing.assert_array_equal(as_f32(a), as_f32(want_a))
    m = dr.combine_rows(moe, 2, x.dtype)
    xn, n = dr.residual_ln_ref(x, proj, moe, lnw, eps=1e-5, pad_rows=8)
    np.testing.assert_array_equal(as_f32(xn), as_f32((x + a) + m))
    assert n is not None and n.shape == (8, 256)


def test_problems_are_named():
    rng = fresh_rng()
    x, proj, moe, _ = _case(rng, 2, 96, 2, 8, 2, 8)
    assert "power of two" in (dr.residual_ln_problem(x, proj, moe, 8) or "")
    x, proj, moe, _ = _case(rng, 2, 128, 2, 8, 2, 8)
    assert "multiple of" in (dr.residual_ln_problem(x, proj, moe, 8) or "")
    x, proj, moe, _ = _case(rng, 2, 256, 2, 8, 2, 8)
    assert "pad_rows" in (dr.residual_ln_problem(x, proj, moe, 1) or "")
    with pytest.raises(ValueError, match="do not fit"):
        dr.residual_ln_kernel(x, proj._replace(rows=3), moe, None, eps=1e-5, pad_rows=8, interpret=True)


def test_lowers_at_md3_decode_shapes():
    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    for T, ln in [(1, True), (8, True), (1, False)]:
        def f(x, parts, bias, y, dest, w, n_valid, scale, shift, T=T, ln=ln):
            return dr.residual_ln_kernel(x, dr.ProjParts(parts, bias, T), dr.ExpertRows(y, dest, w, n_valid),
                                         (scale, shift) if ln else None, eps=1e-5, pad_rows=8)
        args = (_SDS((T, 2048), BF16), _SDS((8, 2048, 8), jnp.float32), _SDS((2048,), BF16),
                _SDS((512, 2048), BF16), _SDS((8, 8), jnp.int32), _SDS((8, 8), jnp.float32), _SDS((1,), jnp.int32),
                _SDS((2048,), BF16), _SDS((2048,), BF16))
        with jax.sharding.use_abstract_mesh(mesh):
            text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text
