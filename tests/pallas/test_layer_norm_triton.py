"""The decode MoE layer's LayerNorm kernel (`layer_norm_triton`): interpreted on the CPU against the
jnp path's expressions, its padding and f16 copy, the dispatch in `ops.decode_moe_layer_norm`, and
its lowering at the decoder's shapes; the same for its variant that first forms the previous
layer's residual (`residual_layer_norm_rows_kernel`, `ops.decode_residual_layer_norm`).

Bounds of the residual variant: x' is formed with the jnp path's roundings (each add rounded to
x's dtype) but the expert-weighted sum runs in choice order in f32 where XLA may reduce in another
order, so an x' value may land one step of x's dtype away (2^-7 of the row's largest value for
bf16); LN(x') then follows within the same bound scaled by the normalisation (2^-5 of the row's
largest value). Padding rows are exactly zero; NaN in a padding token's expert rows never leaks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType
from kernel_helpers import as_f32, fresh_rng

from kestrel_jax.pallas import layer_norm_triton as L
from kestrel_jax.pallas import ops
from kestrel_jax.pallas.decode_residual import ExpertRows
from kestrel_jax.pallas.moe import ExpertWeights

BF16 = jnp.bfloat16
_SDS = jax.ShapeDtypeStruct


@pytest.mark.parametrize("T,D,dtype,pad", [(1, 2048, BF16, 8), (3, 256, BF16, 8), (5, 128, jnp.float32, 16),
                                           (8, 256, BF16, 8), (1, 2048, BF16, 1)])
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
        return None if out is None else [None if o is None else jax.tree.map(lambda a: (a.shape, a.dtype), o)
                                         for o in out]

    with ops.use_backend("reference"):
        assert ops.decode_moe_layer_norm(x, s, s, _experts(True), eps=1e-5, pad_rows=8) is None
    with ops.use_backend("kernel"):
        monkeypatch.delenv("KESTREL_JAX_LN_KERNEL", raising=False)
        monkeypatch.delenv("KESTREL_JAX_W8A8_MIN_TOKENS", raising=False)
        assert shapes(_experts(True)) == [((8, 256), BF16), None]  # W8A8 (the default): no f16 operand
        monkeypatch.setenv("KESTREL_JAX_W8A8_MIN_TOKENS", "2")  # W8A16 at one row
        assert shapes(_experts(True)) == [((8, 256), BF16), ((8, 256), jnp.float16)]
        assert shapes(_experts(True), rows=4) == [((8, 256), BF16), None]  # W8A8 from 2 rows
        assert shapes(_experts(False)) == [((8, 256), BF16), None]  # bf16 experts
        monkeypatch.setenv("KESTREL_JAX_LN_KERNEL", "0")  # the A/B switch: XLA's launches
        assert shapes(_experts(True)) is None


def test_lowers_at_decoder_shapes():
    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    # (1, 1): a dense layer's one-row LayerNorm, unpadded (`ops.decode_dense_layer_norm`)
    for T, f16, pad in [(1, True, 8), (8, False, 8), (1, False, 1)]:
        def f(x, s, b, f16=f16, pad=pad):
            return L.layer_norm_rows_kernel(x, s, b, eps=1e-5, pad_rows=pad, f16_copy=f16)
        with jax.sharding.use_abstract_mesh(mesh):
            text = jax.jit(f).trace(_SDS((T, 2048), BF16), _SDS((2048,), BF16), _SDS((2048,), BF16)).lower(
                lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text


def _residual_case(rng, T: int, D: int, K: int, R: int, dtype):
    x = jnp.asarray(rng.standard_normal((T, D)) * 3.0 + 1.0, dtype)
    # the projection as the decode GEMM's padded rows: its padding rows (NaN here) are never read
    a_rows = np.full((-(-T // 8) * 8, D), np.nan, np.float32)
    a_rows[:T] = rng.standard_normal((T, D))
    a = jnp.asarray(a_rows, dtype)
    y = rng.standard_normal((R, D)).astype(np.float32)
    P = max(8, T)  # the routing tables' token width: columns >= T are never read
    dest = np.stack([rng.permutation(R - K)[:P] for _ in range(K)]).astype(np.int32)
    n_valid = T
    if T > 1:
        n_valid = T - 1  # a padding token: its rows (no other token's) are NaN and must not leak
        dest[:, T - 1] = np.arange(R - K, R)
        y[R - K:] = np.nan
    w = rng.random((K, P)).astype(np.float32)
    moe = ExpertRows(jnp.asarray(y, dtype), jnp.asarray(dest), jnp.asarray(w / w.sum(0, keepdims=True)),
                     jnp.asarray([n_valid], jnp.int32))
    scale = jnp.asarray(rng.uniform(0.5, 1.5, D), dtype)
    bias = jnp.asarray(rng.standard_normal(D) * 0.1, dtype)
    return x, a, moe, scale, bias


def _close_rows(got, want, rtol):
    got, want = as_f32(got), as_f32(want)
    assert np.isfinite(got).all()
    scale = np.abs(want).max(axis=-1, keepdims=True)
    assert (np.abs(got - want) <= rtol * scale).all(), np.abs(got - want).max()


@pytest.mark.parametrize("T,D,K,R,dtype,pad", [(1, 2048, 8, 64, BF16, 8),  # MD3 batch 1
                                               (5, 256, 4, 40, BF16, 8),  # a padding token among five
                                               (3, 128, 2, 16, jnp.float32, 16)])
def test_residual_kernel_matches_the_jnp_path(T, D, K, R, dtype, pad):
    rng = fresh_rng()
    x, a, moe, scale, bias = _residual_case(rng, T, D, K, R, dtype)
    got_x, n, n16 = L.residual_layer_norm_rows_kernel(x, a, moe, scale, bias, eps=1e-5, pad_rows=pad, f16_copy=True,
                                                      interpret=True)
    want_x, want_n, _ = jax.jit(lambda *args: L.residual_layer_norm_rows_ref(*args, eps=1e-5, pad_rows=pad))(
        x, a, moe, scale, bias)
    assert got_x.shape == (T, D) and got_x.dtype == dtype and n.shape == (pad, D) and n.dtype == dtype
    assert n16 is not None and n16.dtype == jnp.float16
    tight = 2.0**-7 if dtype == BF16 else 2.0**-20
    _close_rows(got_x, want_x, tight)
    _close_rows(n[:T], want_n[:T], 4 * tight)
    assert not as_f32(n)[T:].any() and not as_f32(n16)[T:].any()  # zero padding rows
    # the normalised rows are the plain kernel's on the x' it wrote
    plain, _ = L.layer_norm_rows_kernel(got_x, scale, bias, eps=1e-5, pad_rows=pad, interpret=True)
    np.testing.assert_array_equal(as_f32(n), as_f32(plain))
    np.testing.assert_array_equal(as_f32(n16)[:T], np.clip(as_f32(n)[:T], -65504, 65504).astype(np.float16)
                                  .astype(np.float32))
    _, _, none = L.residual_layer_norm_rows_kernel(x, a, moe, scale, bias, eps=1e-5, pad_rows=pad, interpret=True)
    assert none is None


def test_residual_problems_are_named():
    z = jnp.zeros
    moe = ExpertRows(z((16, 128), BF16), z((2, 8), jnp.int32), z((2, 8)), z((1,), jnp.int32))
    x = z((1, 128), BF16)
    assert L.residual_layer_norm_rows_problem(x, x, moe, z((128,)), z((128,)), 8) is None
    assert "attention output" in (L.residual_layer_norm_rows_problem(x, z((1, 128)), moe, z((128,)), z((128,)), 8)
                                  or "")
    bad = moe._replace(y=z((16, 64), BF16))
    assert "expert rows" in (L.residual_layer_norm_rows_problem(x, x, bad, z((128,)), z((128,)), 8) or "")
    assert "pad_rows" in (L.residual_layer_norm_rows_problem(z((9, 128), BF16), z((9, 128), BF16), moe, z((128,)),
                                                            z((128,)), 8) or "")
    with pytest.raises(ValueError, match="attention output"):
        L.residual_layer_norm_rows_kernel(x, z((1, 128)), moe, z((128,)), z((128,)), eps=1e-5, pad_rows=8,
                                          interpret=True)


def test_residual_dispatch(monkeypatch: pytest.MonkeyPatch):
    s = jnp.ones((256,), BF16)
    moe = ExpertRows(jnp.zeros((16, 256), BF16), jnp.zeros((2, 8), jnp.int32), jnp.zeros((2, 8)),
                     jnp.ones((1,), jnp.int32))

    def shapes(experts, a_dtype=BF16):  # traced only: the kernel cannot run un-interpreted on the CPU
        x, a = jnp.ones((1, 256), BF16), jnp.ones((1, 256), a_dtype)
        out = jax.eval_shape(lambda: ops.decode_residual_layer_norm(x, a, moe, s, s, experts, eps=1e-5, pad_rows=8))
        return None if out is None else [None if o is None else (o.shape, o.dtype) for o in out]

    for name in ("KESTREL_JAX_LN_KERNEL", "KESTREL_JAX_W8A8_MIN_TOKENS", "KESTREL_JAX_RESIDUAL_LN"):
        monkeypatch.delenv(name, raising=False)
    with ops.use_backend("reference"):
        assert shapes(_experts(True)) is None
    with ops.use_backend("kernel"):
        assert shapes(_experts(True)) is None  # opt-in: off by default
        monkeypatch.setenv("KESTREL_JAX_RESIDUAL_LN", "1")
        assert shapes(_experts(True)) == [((1, 256), BF16), ((8, 256), BF16), None]
        assert shapes(_experts(True), a_dtype=jnp.float32) is None  # shapes it does not take: XLA's path
        monkeypatch.setenv("KESTREL_JAX_W8A8_MIN_TOKENS", "2")  # W8A16 at one row: the f16 operand too
        assert shapes(_experts(True)) == [((1, 256), BF16), ((8, 256), BF16), ((8, 256), jnp.float16)]
        monkeypatch.setenv("KESTREL_JAX_LN_KERNEL", "0")
        assert shapes(_experts(True)) is None


def test_residual_lowers_at_decoder_shapes():
    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)

    def f(x, a, y, dest, w, nv, s, b):
        return L.residual_layer_norm_rows_kernel(x, a, ExpertRows(y, dest, w, nv), s, b, eps=1e-5, pad_rows=8)

    args = (_SDS((1, 2048), BF16), _SDS((1, 2048), BF16), _SDS((64, 2048), BF16), _SDS((8, 8), jnp.int32),
            _SDS((8, 8), jnp.float32), _SDS((1,), jnp.int32), _SDS((2048,), BF16), _SDS((2048,), BF16))
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text
