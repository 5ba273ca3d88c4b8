"""The decode MoE layer's LayerNorm kernel (`layer_norm_triton`): interpreted on the CPU against the
jnp path's expressions, its padding and f16 copy, the dispatch in `ops.decode_moe_layer_norm`, and
its lowering at the decoder's shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType
from kernel_helpers import as_f32, fresh_rng

from kestrel_jax.pallas import layer_norm_triton as L
from kestrel_jax.pallas import ops
from kestrel_jax.pallas.moe import ExpertWeights

BF16 = jnp.bfloat16
_SDS = jax.ShapeDtypeStruct


@pytest.mark.parametrize("T,D,dtype,pad", [(1, 2048, BF16, 8), (3, 256, BF16, 8), (5, 128, jnp.float32, 16),
                                           (8, 256, BF16, 8)])
def test_kernel_matches_the_jnp_path(T, D, dtype, pad):
    rng = fresh_rng()
    # an offset mean and a large spread (the one-pass variance's cancellation), and an outlier
    x = rng.standard_normal((T, D)) * 3.0 + 5.0
    x[0, 7] = 3000.0
    x = jnp.asarray(x, dtype)
    scale = jnp.asarray(rng.uniform(0.5, 1.5, D), dtype)
    bias = jnp.asarray(rng.standard_normal(D) * 0.1, dtype)
    n, n16 = L.layer_norm_rows_kernel(x, scale, bias, eps=1e-5, pad_rows=pad, f16_copy=True, interpret=True)
    r, r16 = jax.jit(lambda *a: L.layer_norm_rows_ref(*a, eps=1e-5, pad_rows=pad, f16_copy=True))(x, scale, bias)
    assert n.shape == (pad, D) and n.dtype == dtype and n16 is not None and n16.dtype == jnp.float16
    assert not as_f32(n)[T:].any() and not as_f32(n16)[T:].any()  # zero padding rows
    # the same expressions; the sums' order may differ from XLA's: within one rounding of the output
    a, b = as_f32(n)[:T], as_f32(r)[:T]
    ulp = 2.0**-7 if dtype == BF16 else 2.0**-20
    assert (np.abs(a - b) <= ulp * np.abs(b) + 1e-6).all(), np.abs(a - b).max()
    np.testing.assert_array_equal(as_f32(n16)[:T], np.clip(a, -65504, 65504).astype(np.float16).astype(np.float32))
    plain, none = L.layer_norm_rows_kernel(x, scale, bias, eps=1e-5, pad_rows=pad, interpret=True)
    assert none is None
    np.testing.assert_array_equal(as_f32(plain), as_f32(n))


def test_f16_copy_saturates():
    x = jnp.asarray(np.r_[np.zeros(127), 1.0][None], BF16)  # one large normalised value
    scale = jnp.full((128,), 9000.0, BF16)
    n, n16 = L.layer_norm_rows_kernel(x, scale, jnp.zeros((128,), BF16), eps=1e-5, pad_rows=8, f16_copy=True,
                                      interpret=True)
    assert n16 is not None and as_f32(n)[0].max() > 65504
    assert as_f32(n16)[0].max() == 65504.0 and np.isfinite(as_f32(n16)).all()


def test_problems_are_named():
    z = jnp.zeros
    assert "power of two" in (L.layer_norm_rows_problem(z((1, 96), BF16), z((96,)), z((96,)), 8) or "")
    assert "pad_rows" in (L.layer_norm_rows_problem(z((9, 128), BF16), z((128,)), z((128,)), 8) or "")
    assert "scale" in (L.layer_norm_rows_problem(z((1, 128), BF16), z((64,)), z((128,)), 8) or "")
    assert "bf16 or f32" in (L.layer_norm_rows_problem(z((1, 128), jnp.float16), z((128,)), z((128,)), 8) or "")
    with pytest.raises(ValueError, match="pad_rows"):
        L.layer_norm_rows_kernel(z((9, 128), BF16), z((128,)), z((128,)), eps=1e-5, pad_rows=8, interpret=True)


def _experts(fp8: bool, D: int = 256, E: int = 16, inner: int = 128) -> ExpertWeights:
    dt = jnp.float8_e4m3fn if fp8 else BF16
    scales = (jnp.ones((E, 2 * inner)), jnp.ones((E, D))) if fp8 else (None, None)
    return ExpertWeights(jnp.zeros((E, 2 * inner, D), dt), jnp.zeros((E, D, inner), dt), *scales)


def test_dispatch_forms_the_f16_copy_only_for_w8a16_experts(monkeypatch: pytest.MonkeyPatch):
    x, s = jnp.ones((1, 256), BF16), jnp.ones((256,), BF16)

    def shapes(experts, rows=1):  # traced only: the kernel cannot run un-interpreted on the CPU
        xs = jnp.ones((rows, 256), BF16)
        out = jax.eval_shape(lambda: ops.decode_moe_layer_norm(xs, s, s, experts, eps=1e-5, pad_rows=8))
        return None if out is None else [None if o is None else (o.shape, o.dtype) for o in out]

    with ops.use_backend("reference"):
        assert ops.decode_moe_layer_norm(x, s, s, _experts(True), eps=1e-5, pad_rows=8) is None
    with ops.use_backend("kernel"):
        monkeypatch.delenv("KESTREL_JAX_LN_KERNEL", raising=False)
        monkeypatch.delenv("KESTREL_JAX_W8A8_MIN_TOKENS", raising=False)
        assert shapes(_experts(True)) == [((8, 256), BF16), None]  # W8A8 (the default): no f16 operand
        monkeypatch.setenv("KESTREL_JAX_W8A8_MIN_TOKENS", "2")  # W8A16 at one row
        assert shapes(_experts(True)) == [((8, 256), BF16), ((8, 256), jnp.float16)]
        assert shapes(_experts(True), rows=4) == [((8, 256), BF16), None]  # W8A8 from 2 rows: no f16 operand
        assert shapes(_experts(False)) == [((8, 256), BF16), None]  # bf16 experts
        monkeypatch.setenv("KESTREL_JAX_LN_KERNEL", "0")  # the A/B switch: XLA's launches
        assert shapes(_experts(True)) is None


def test_lowers_at_decoder_shapes():
    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    for T, f16 in [(1, True), (8, False)]:
        def f(x, s, b, f16=f16):
            return L.layer_norm_rows_kernel(x, s, b, eps=1e-5, pad_rows=8, f16_copy=f16)
        with jax.sharding.use_abstract_mesh(mesh):
            text = jax.jit(f).trace(_SDS((T, 2048), BF16), _SDS((2048,), BF16), _SDS((2048,), BF16)).lower(
                lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text
