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


@pytest.mark.parametrize("mode", ["x", "merge"])
def test_row0_partials_are_row_zero_of_the_padded_ones(mode: str):
    """`row0` gives column 0 of the padded partials [S, N, 8] (the one row's), bit for bit, as
    [S, N], for an x row and a one-row `merge`; the other columns are zero."""
    rng = fresh_rng()
    kw: dict = {}
    if mode == "x":
        x, w, splits = _bf16(rng, (1, 384), 1.0), _bf16(rng, (384, 192), 0.05), 3
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


def _expert_rows(rng: np.random.Generator, K: int, k: int = 8, R: int = 24, P: int = 8, valid: int = 1):
    """An MoE layer's unreduced output for token 0: y [R, K] bf16 (rows no choice points at NaN:
    rows the down GEMM never wrote), dest [k, P] (token 0's k rows distinct), softmax weights [k, P],
    n_valid."""
    dest = rng.integers(0, R, (k, P))
    dest[:, 0] = rng.permutation(R)[:k]
    y = np.asarray(rng.standard_normal((R, K)) * rng.uniform(0.5, 4.0, (R, 1)), np.float32)
    unused = np.setdiff1d(np.arange(R), dest[:, 0])
    y[unused] = np.nan
    if not valid:
        y[:] = np.nan  # an empty step: nothing written, nothing read into x'
    w = rng.dirichlet(np.ones(k), P).T.astype(np.float32)
    return (jnp.asarray(y, BF16), jnp.asarray(dest, jnp.int32), jnp.asarray(w), jnp.asarray([valid], jnp.int32))


def _exact_moe_residual(x: jax.Array, parts: jax.Array, bias: jax.Array | None, expert) -> np.ndarray:
    """`_exact_residual` + bf16(sum_j w[j, 0] y[dest[j, 0]] in f32, j in order; 0 for an empty step),
    rounded to bf16."""
    y, dest, w, nv = (np.asarray(a) for a in expert)
    m = np.zeros(y.shape[1], np.float32)
    if nv[0] > 0:
        m = (w[0, 0] * y[dest[0, 0]].astype(np.float32)).astype(np.float32)
        for j in range(1, dest.shape[0]):
            m = (m + w[j, 0] * y[dest[j, 0]].astype(np.float32)).astype(np.float32)
    first = _exact_residual(x, parts, bias).astype(np.float32)
    return (first + m.astype(BF16).astype(np.float32)[None]).astype(BF16)


@pytest.mark.parametrize("valid", [1, 0])
def test_rows_kernel_adds_an_moe_layers_residual(valid: int):
    """With expert rows (an MoE layer's output before its weighted sum): x' = (x + finished
    partials) + bf16(the weighted sum of token 0's k rows, in order), as the numpy reference rounds
    each operation, and within one bf16 rounding of `residual_row_ref` (XLA sums the k rows in an
    order of its own); rows no choice points at (NaN) are never read, and an empty step (n_valid 0)
    adds nothing of them; the products are the rows kernel's fed x'."""
    rng = fresh_rng()
    K, S = 512, 4
    x = jnp.asarray(rng.standard_normal((1, K)) * 2, BF16)
    parts = jnp.asarray(rng.standard_normal((S, K)) * 4, jnp.float32)
    rbias = _bf16(rng, (K,), 0.5)
    expert = _expert_rows(rng, K, valid=valid)
    scale, shift = jnp.asarray(rng.uniform(0.5, 1.5, K), BF16), _bf16(rng, (K,), 0.1)
    w1, b1 = _bf16(rng, (K, 192), 0.05), _bf16(rng, (192,), 1.0)
    w2, b2 = _bf16(rng, (K, 64), 0.05), _bf16(rng, (64,), 1.0)
    run = functools.partial(g.gemv_rows, stages=3, interpret=True, ln=(scale, shift), ln_eps=1e-5)
    y1, y2, n, xr = jax.jit(functools.partial(run, residual=(parts, rbias, expert)))(x, w1, b1, w2, b2)
    want = _exact_moe_residual(x, parts, rbias, expert).astype(np.float32)
    got = as_f32(xr)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, want)
    if not valid:
        np.testing.assert_array_equal(got, _exact_residual(x, parts, rbias).astype(np.float32))
    ref = as_f32(g.residual_row_ref(x, parts, rbias, expert))
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(ref), 2.0**-126))) - 7)
    assert (np.abs(got - ref) <= ulp).all()
    p1, p2, pn = jax.jit(run)(xr, w1, b1, w2, b2)
    for a, b in ((y1, p1), (y2, p2), (n, pn)):
        np.testing.assert_array_equal(as_f32(a), as_f32(b))


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


def test_rows_kernel_refuses_expert_rows_it_cannot_read():
    K = 512
    x, p, b = jnp.zeros((1, K), BF16), jnp.zeros((2, K), jnp.float32), jnp.zeros((K,), BF16)
    y, dest, w, nv = jnp.zeros((16, K), BF16), jnp.zeros((8, 8), jnp.int32), jnp.zeros((8, 8), jnp.float32), \
        jnp.ones((1,), jnp.int32)
    assert g.residual_problem(x, p, b, (y, dest, w, nv)) is None
    for bad in ((y[:, :256], dest, w, nv), (y.astype(jnp.float32), dest, w, nv), (y, dest.astype(jnp.float32), w, nv),
                (y, dest, w[:4], nv), (y, dest, w, jnp.ones((2,), jnp.int32)), (y, jnp.zeros((17, 8), jnp.int32),
                                                                                jnp.zeros((17, 8), jnp.float32), nv)):
        assert "expert rows" in (g.residual_problem(x, p, b, bad) or ""), [a.shape for a in bad]


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


def test_moe_residual_lowers_at_md3_shapes():
    """Mosaic GPU lowering for an H100 of an MoE layer's QKV + router rows kernel ([2048, 6144] +
    [2048, 64], tau dots) adding the previous MoE layer's residual: the projection's row-0 partials
    [4, 2048] and bias, 8 expert rows gathered from [64, 2048] by the [8, 8] tables."""
    H = g.TAU_ROWS // 2
    f32, i32 = jnp.float32, jnp.int32

    def rows(x, w1, b1, w2, b2, wq, wv, sc, sh, p, rb, y, d, w, nv):
        return g.gemv_rows(x, w1, b1, w2, b2, tau_w=(wq, wv), ln=(sc, sh), ln_eps=1e-5,
                           residual=(p, rb, (y, d, w, nv)))

    with jax.sharding.use_abstract_mesh(_h100_mesh()):
        text = jax.jit(rows).trace(
            _SDS((1, 2048), BF16), _SDS((2048, 6144), BF16), _SDS((6144,), BF16), _SDS((2048, 64), BF16),
            _SDS((64,), BF16), _SDS((H, 6144), BF16), _SDS((H, 6144), BF16), _SDS((2048,), BF16), _SDS((2048,), BF16),
            _SDS((4, 2048), f32), _SDS((2048,), BF16), _SDS((64, 2048), BF16), _SDS((8, 8), i32), _SDS((8, 8), f32),
            _SDS((1,), i32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "kestrel_gemv_rows" in text
