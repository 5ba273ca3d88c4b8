"""The one-row residual add moved into the decode GEMM kernels (KESTREL_JAX_DENSE_RESIDUAL_IN_ROWS):
`gemv_mgpu.gemv_partials(row0=True)`, the row-0 split partials of a one-row product, and
`gemv_mgpu.gemv_rows(ln=..., residual=...)`, the rows kernel forming x + the finished partials
before its LayerNorm. Interpreted on the CPU against the padded partials, an exactly rounded numpy
reference and the rows kernel fed the new row; refusals; `ops.decode_ln_dense_in`'s dispatch; the
Mosaic lowering for an H100 at MD2's shapes."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType
from kernel_helpers import as_f32, fresh_rng

from kestrel_jax.pallas import gemv_mgpu as g
from kestrel_jax.pallas import ops

BF16 = jnp.bfloat16
_SDS = jax.ShapeDtypeStruct


def _bf16(rng: np.random.Generator, shape, std: float) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape) * std, BF16)


@pytest.mark.parametrize("mode", ["x", "gelu_in", "merge"])
def test_row0_partials_are_row_zero_of_the_padded_ones(mode: str):
    """`row0` gives column 0 of the padded partials [S, N, 8] (the one row's), bit for bit, as
    [S, N], for an x row, a `gelu_in` row and a one-row `merge`; the other columns are zero."""
    rng = fresh_rng()
    kw: dict = {}
    if mode == "x":
        x, w, splits = _bf16(rng, (1, 384), 1.0), _bf16(rng, (384, 192), 0.05), 3
    elif mode == "gelu_in":
        x, w, splits = None, _bf16(rng, (512, 128), 0.05), 2
        kw["gelu_in"] = (_bf16(rng, (1, 256), 1.0), _bf16(rng, (8, 320), 1.0), 64)
    else:
        H, S = 4, 2
        x, w, splits = None, _bf16(rng, (H * 64, 128), 0.05), None
        o = jnp.asarray(rng.standard_normal((8, H, S, 64)), jnp.float32)
        lse = jnp.asarray(rng.standard_normal((8, H, S)), jnp.float32)
        kw["merge"] = (o, lse, 1)
    run = functools.partial(g.gemv_partials, x, w, splits=splits, stages=2, interpret=True, **kw)
    padded = np.asarray(jax.jit(run)())
    got = np.asarray(jax.jit(functools.partial(run, row0=True))())
    assert got.shape == (padded.shape[0], w.shape[1]) and got.dtype == np.float32
    np.testing.assert_array_equal(got, padded[:, :, 0])
    assert not padded[:, :, 1:].any() and np.abs(got).max() > 0


@pytest.mark.parametrize("rows,row_major", [(2, False), (64, True)])
def test_row0_partials_refuse_more_rows(rows: int, row_major: bool):
    x, w = jnp.zeros((rows, 256), BF16), jnp.zeros((256, 64), BF16)
    with pytest.raises(ValueError, match="row-0 partials need one row"):
        jax.eval_shape(functools.partial(g.gemv_partials, row0=True, row_major=row_major), x, w)


def _exact_residual(x: jax.Array, parts: jax.Array, bias: jax.Array | None) -> np.ndarray:
    """x + (the partials summed in order in f32, rounded to bf16, + bias rounded to bf16), rounded
    to bf16: numpy, one rounding per operation."""
    p = np.asarray(parts, np.float32)
    s = p[0]
    for i in range(1, p.shape[0]):
        s = (s + p[i]).astype(np.float32)
    y = s.astype(BF16)
    if bias is not None:
        y = (y.astype(np.float32) + np.asarray(bias).astype(np.float32)).astype(BF16)
    return (np.asarray(x).astype(np.float32) + y.astype(np.float32)[None]).astype(BF16)


@pytest.mark.parametrize("K,S,with_bias,N2", [(384, 1, False, None), (512, 4, True, 64), (256, 3, True, None)])
def test_rows_kernel_adds_the_residual_before_its_layer_norm(K: int, S: int, with_bias: bool, N2: int | None):
    """x' = x + finished(partials, bias), rounded as the numpy reference rounds each operation,
    appended last ([1, K]) and equal to `residual_row_ref`'s; the normalised rows and products are
    the rows kernel's with `ln` fed x', bit for bit. The partials are large against x (the sum's
    rounding and the bias add's both show) and of mixed sign (cancellation)."""
    rng = fresh_rng()
    x = jnp.asarray(rng.standard_normal((1, K)) * rng.uniform(0.5, 3.0) + rng.uniform(-1, 1), BF16)
    parts = jnp.asarray(rng.standard_normal((S, K)) * rng.uniform(1.0, 8.0, (S, 1)), jnp.float32)
    rbias = _bf16(rng, (K,), 0.5) if with_bias else None
    scale = jnp.asarray(rng.uniform(0.5, 1.5, K), BF16)
    shift = _bf16(rng, (K,), 0.1)
    ws = [_bf16(rng, (K, n), 0.05) for n in (192, N2) if n]
    bs = [_bf16(rng, (w.shape[1],), 1.0) for w in ws]
    args = (x, ws[0], bs[0]) if N2 is None else (x, ws[0], bs[0], ws[1], bs[1])
    run = functools.partial(g.gemv_rows, stages=3, interpret=True, ln=(scale, shift), ln_eps=1e-5)
    *ys, n, xr = jax.jit(functools.partial(run, residual=(parts, rbias)))(*args)
    want = _exact_residual(x, parts, rbias)
    assert xr.shape == (1, K) and xr.dtype == BF16
    np.testing.assert_array_equal(as_f32(xr), want.astype(np.float32))
    np.testing.assert_array_equal(as_f32(g.residual_row_ref(x, parts, rbias)), want.astype(np.float32))
    assert (as_f32(xr) != as_f32(x)).any()
    *plain, n_plain = jax.jit(run)(xr, *args[1:])
    np.testing.assert_array_equal(as_f32(n), as_f32(n_plain))
    for y, p in zip(ys, plain, strict=True):
        np.testing.assert_array_equal(as_f32(y), as_f32(p))


@pytest.mark.parametrize("parts,bias,ln,match", [
    ((2, 512), None, False, "without `ln`"),
    ((2, 448), None, True, r"must be \[1..16, 512\]"),
    ((17, 512), None, True, r"must be \[1..16, 512\]"),
    ((2, 512, "bf16"), None, True, "must be float32"),
    ((2, 512), (512, "f32"), True, "residual bias"),
    ((2, 512), (256, "bf16"), True, "residual bias"),
])
def test_rows_kernel_refuses_a_residual_it_cannot_add(parts, bias, ln, match):
    K = 512
    p = jnp.zeros(parts[:2], BF16 if parts[2:] == ("bf16",) else jnp.float32)
    b = None if bias is None else jnp.zeros((bias[0],), jnp.float32 if bias[1] == "f32" else BF16)
    kw: dict[str, Any] = {"ln": (jnp.ones((K,), BF16), jnp.zeros((K,), BF16))} if ln else {}
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(functools.partial(g.gemv_rows, residual=(p, b), **kw), jnp.zeros((1, K), BF16),
                       jnp.zeros((K, 64), BF16), None)


def test_decode_ln_dense_in_hands_the_residual_on(monkeypatch: pytest.MonkeyPatch):
    """With a `PendingResidual`, `ops.decode_ln_dense_in` runs the rows kernel on its x with its
    partials and bias and returns the kernel's three outputs; partials the kernel refuses give None
    (the model then adds in XLA)."""
    seen: list[tuple] = []

    def fake(x, w, b, *, ln=None, ln_eps=None, stages=None, ln_tiles_ahead=None, residual=None):
        seen.append((x.shape, None if residual is None else (residual[0].shape, residual[1] is not None)))
        out = (jnp.pad(x @ w, ((0, 7), (0, 0))), jnp.pad(x, ((0, 7), (0, 0))))
        return out if residual is None else (*out, x + 1)

    monkeypatch.setattr(g, "gemv_rows", fake)
    monkeypatch.setattr(g, "gemv_supported", lambda x, w: True)
    ops._jitted.cache_clear()
    K, N = 512, 192
    scale, shift = jnp.ones((K,), BF16), jnp.zeros((K,), BF16)
    w, b = jnp.ones((K, N), BF16), jnp.zeros((N,), BF16)
    pending = ops.PendingResidual(jnp.ones((1, K), BF16), jnp.zeros((4, K), jnp.float32), jnp.zeros((K,), BF16))
    with ops.use_backend("kernel"):
        out = ops.decode_ln_dense_in(jnp.zeros((1, K), BF16), scale, shift, w, b, eps=1e-5, residual=pending)
        assert out is not None and [o.shape for o in out] == [(8, N), (8, K), (1, K)]
        np.testing.assert_array_equal(as_f32(out[2]), 2.0)  # the pending row's x, not the x passed
        assert seen == [((1, K), ((4, K), True))]
        bad = pending._replace(parts=jnp.zeros((4, K), BF16))
        assert ops.decode_ln_dense_in(pending.x, scale, shift, w, b, eps=1e-5, residual=bad) is None
        assert len(seen) == 1
    np.testing.assert_array_equal(
        as_f32(ops.add_residual(pending)), as_f32(g.residual_row_ref(pending.x, pending.parts, pending.bias)))


def _h100_mesh() -> AbstractMesh:
    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    return AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)


def test_residual_kernels_lower_at_md2_shapes():
    """Mosaic GPU lowering for an H100: MD2's one-row joined output + fc2 product's row-0 partials
    ([1, 10240] x [10240, 2048], 4 K ranges, 8 stages) and the next layer's rows kernel of its joined
    QKV + fc1 product ([2048, 14336]) adding them before its LayerNorm."""
    with jax.sharding.use_abstract_mesh(_h100_mesh()):
        out = jax.jit(functools.partial(g.gemv_partials, splits=4, stages=8, row0=True)).trace(
            _SDS((1, 10240), BF16), _SDS((10240, 2048), BF16)).lower(lowering_platforms=("cuda",)).as_text()
        assert "kestrel_gemv" in out

        def rows(x, w, b, sc, sh, p, rb):
            return g.gemv_rows(x, w, b, ln=(sc, sh), ln_eps=1e-5, residual=(p, rb))

        text = jax.jit(rows).trace(_SDS((1, 2048), BF16), _SDS((2048, 14336), BF16), _SDS((14336,), BF16),
                                   _SDS((2048,), BF16), _SDS((2048,), BF16), _SDS((4, 2048), jnp.float32),
                                   _SDS((2048,), BF16)).lower(lowering_platforms=("cuda",)).as_text()
        assert "kestrel_gemv_rows" in text
