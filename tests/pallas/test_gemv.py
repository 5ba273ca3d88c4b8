"""The decode GEMM kernel (`gemv_mgpu`): interpreted on the CPU against float64 and the jnp path
the model runs otherwise, cross-lowered for an H100 at the decoder's shapes, and the dispatch in
`ops.small_linear`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType
from kernel_helpers import fresh_rng

from kestrel_jax.pallas import gemv_mgpu as g
from kestrel_jax.pallas import ops
from kestrel_jax.pallas.qkv_epilogue import TauDots, TauWeights

BF16 = jnp.bfloat16
_SDS = jax.ShapeDtypeStruct


@pytest.mark.parametrize("M,K,N,splits", [(1, 512, 192, None), (3, 256, 128, 2), (8, 384, 64, 6), (13, 128, 256, 1)])
def test_gemv_interpreted_matches_float64_and_the_jnp_path(M, K, N, splits):
    rng = fresh_rng()
    x = jnp.asarray(rng.standard_normal((M, K)), BF16)
    w = jnp.asarray(rng.standard_normal((K, N)) * 0.05, BF16)
    b = jnp.asarray(rng.standard_normal((N,)), BF16)
    y = jax.jit(functools.partial(g.gemv, splits=splits, interpret=True))(x, w, b)
    assert y.shape == (M, N) and y.dtype == BF16
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64) + np.asarray(b, np.float64)
    jnp_path = np.asarray((jnp.dot(x, w) + b).astype(jnp.float32), np.float64)  # Linear's product
    err = np.abs(np.asarray(y.astype(jnp.float32), np.float64) - exact).max()
    # two bf16 roundings (product, bias add) of values up to |exact|: the jnp path's own bound
    bound = 2 * 2.0**-8 * np.abs(exact).max()
    assert err <= bound, (err, bound)
    assert np.abs(jnp_path - exact).max() <= bound
    # without a bias: the f32 sum of the partials rounded once
    y0 = np.asarray(jax.jit(functools.partial(g.gemv, splits=splits, interpret=True))(x, w).astype(jnp.float32))
    assert np.abs(y0 - (exact - np.asarray(b, np.float64))).max() <= 2.0**-8 * np.abs(exact).max() + 1e-6


@pytest.mark.parametrize("rows,splits", [(64, 3), (61, 1)])
def test_gemv_row_major_partials_are_the_same_product(rows: int, splits: int):
    """At 64 rows of x (61 padded to 64 here) `row_major` forms y's partials ([splits, 64, N], x
    as wgmma's A) instead of y^T's: the same product within f32 summation order, the padding rows
    of the partials zero, and fewer than 64 rows refused."""
    rng = fresh_rng()
    K, N = 384, 192
    x = jnp.asarray(rng.standard_normal((rows, K)), BF16)
    w = jnp.asarray(rng.standard_normal((K, N)) * 0.05, BF16)
    b = jnp.asarray(rng.standard_normal((N,)), BF16)
    xp = jnp.pad(x, ((0, 64 - rows), (0, 0)))
    parts = jax.jit(functools.partial(g.gemv_partials, splits=splits, row_major=True, interpret=True))(xp, w)
    assert parts.shape == (splits, 64, N) and parts.dtype == jnp.float32
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    got = np.asarray(parts, np.float64).sum(0)
    assert np.abs(got[:rows] - exact).max() <= 1e-5 * np.abs(exact).max()
    assert not got[rows:].any()
    y = jax.jit(functools.partial(g.gemv, splits=splits, row_major=True, rows=rows, interpret=True))(xp, w, b)
    y_t = jax.jit(functools.partial(g.gemv, splits=splits, rows=rows, interpret=True))(xp, w, b)
    assert y.shape == (rows, N) and y.dtype == BF16
    diff = np.abs(np.asarray(y.astype(jnp.float32)) - np.asarray(y_t.astype(jnp.float32))).max()
    assert diff <= 2.0**-7 * np.abs(exact).max()  # at most a bf16 step apart where the f32 sums round apart
    with pytest.raises(ValueError, match="row-major partials need 64 rows"):
        jax.eval_shape(functools.partial(g.gemv_partials, row_major=True), x[:8], w)


def test_gemv_row_major_partials_with_a_second_product_and_a_gate():
    """Row-major partials beside the launch's other options: a second weight (its columns after the
    first's, [splits, 64, N1 + N2]) and a gate (open: the product; closed: zero partials)."""
    rng = fresh_rng()
    K, n1, n2 = 256, 128, 64
    x = jnp.asarray(rng.standard_normal((64, K)), BF16)
    w1, w2 = (jnp.asarray(rng.standard_normal((K, n)) * 0.05, BF16) for n in (n1, n2))
    exact = np.asarray(x, np.float64) @ np.concatenate([np.asarray(w, np.float64) for w in (w1, w2)], axis=1)
    table = jnp.asarray([[0, 1]], jnp.int32)
    for column, open_ in ((1, True), (0, False)):
        parts = jax.jit(functools.partial(g.gemv_partials, splits=2, row_major=True, interpret=True,
                                          gate=g.Gate(table, 0, column)))(x, w1, w2)
        assert parts.shape == (2, 64, n1 + n2)
        got = np.asarray(parts, np.float64).sum(0)
        if open_:
            assert np.abs(got - exact).max() <= 1e-5 * np.abs(exact).max()
        else:
            assert not got.any()


def test_gemv_pair_equals_the_two_products():
    """Two products of the same rows in one launch (QKV and router): column blocks past the first
    matrix read the second."""
    rng = fresh_rng()
    x = jnp.asarray(rng.standard_normal((1, 256)), BF16)
    w1, w2 = (jnp.asarray(rng.standard_normal((256, n)) * 0.05, BF16) for n in (192, 64))
    b1, b2 = (jnp.asarray(rng.standard_normal((n,)), BF16) for n in (192, 64))
    y1, y2 = jax.jit(functools.partial(g.gemv_pair, splits=2, interpret=True))(x, w1, b1, w2, b2)
    one = jax.jit(functools.partial(g.gemv, splits=2, interpret=True))
    np.testing.assert_array_equal(np.asarray(y1.astype(jnp.float32)), np.asarray(one(x, w1, b1).astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(y2.astype(jnp.float32)), np.asarray(one(x, w2, b2).astype(jnp.float32)))
    with pytest.raises(ValueError):
        jax.eval_shape(g.gemv_pair, x, w1, b1, jnp.zeros((256, 96), BF16), None)  # N2 not a multiple of 64


@pytest.mark.parametrize("M,N1,N2,bias,early", [(1, 192, 64, True, False), (1, 192, 64, True, True),
                                                 (3, 128, None, True, True), (8, 64, 128, False, False)])
def test_gemv_rows_are_the_single_split_product_padded_to_the_row_tile(M, N1, N2, bias, early):
    """Finished bf16 rows from one CTA per column block: bit-identical to `gemv` with one split (the
    same f32 product, rounded, bias added in bf16), rows padded to 8; padding rows are the
    products of x's zero padding rows (the bias). The same with the bias loaded before the stream
    (`bias_early`)."""
    rng = fresh_rng()
    K = 256
    x = jnp.asarray(rng.standard_normal((M, K)), BF16)
    ws = [jnp.asarray(rng.standard_normal((K, n)) * 0.05, BF16) for n in (N1, N2) if n]
    bs = [jnp.asarray(rng.standard_normal((w.shape[1],)), BF16) if bias else None for w in ws]
    args = (x, ws[0], bs[0]) if N2 is None else (x, ws[0], bs[0], ws[1], bs[1])
    out = jax.jit(functools.partial(g.gemv_rows, stages=3, bias_early=early, interpret=True))(*args)
    assert len(out) == len(ws)
    one = jax.jit(functools.partial(g.gemv, splits=1, interpret=True))
    for y, w, b in zip(out, ws, bs, strict=True):
        assert y.shape == (8, w.shape[1]) and y.dtype == BF16
        np.testing.assert_array_equal(np.asarray(y[:M].astype(jnp.float32)),
                                      np.asarray(one(x, w, b).astype(jnp.float32)))
        pad = np.asarray(y[M:].astype(jnp.float32))
        np.testing.assert_array_equal(pad, np.broadcast_to(0 if b is None else np.asarray(b.astype(jnp.float32)),
                                                           pad.shape))
    with pytest.raises(ValueError, match="bias"):
        jax.eval_shape(g.gemv_rows, x, ws[0], jnp.zeros((ws[0].shape[1],), jnp.float32))


@pytest.mark.parametrize("M,N2", [(1, 64), (5, None)])
def test_gemv_rows_tau_dots_are_the_blocks_shares_of_the_tau_products(M, N2):
    """With `tau_w` the first product's CTAs also form their blocks' share of MD3's tau dots
    (GELU of the finished bf16 rows times [wq; wv], f32): the rows are unchanged, and the dots
    summed over blocks match `tau_dots_ref` on those rows to f32 rounding. The padding rows'
    dots are those of the padding rows' products."""
    rng = fresh_rng()
    K, N1, H = 128, 192, g.TAU_ROWS // 2
    x = jnp.asarray(rng.standard_normal((M, K)), BF16)
    w1 = jnp.asarray(rng.standard_normal((K, N1)) * 0.2, BF16)
    b1 = jnp.asarray(rng.standard_normal(N1), BF16)
    wq, wv = (jnp.asarray(rng.standard_normal((H, N1)) * 0.05, BF16) for _ in range(2))
    extra = () if N2 is None else (jnp.asarray(rng.standard_normal((K, N2)) * 0.2, BF16), None)
    run = jax.jit(functools.partial(g.gemv_rows, stages=2, interpret=True))
    plain = run(x, w1, b1, *extra)
    *rows, dots = jax.jit(functools.partial(g.gemv_rows, stages=2, interpret=True, tau_w=(wq, wv)))(
        x, w1, b1, *extra)
    assert len(rows) == len(plain) and dots.shape == (N1 // 64, g.TAU_ROWS, 8) and dots.dtype == jnp.float32
    for a, b in zip(rows, plain, strict=True):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    want = np.asarray(g.tau_dots_ref(rows[0], wq, wv))  # [2H, 8]
    got = np.asarray(dots).sum(0)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 1e-5 * scale, np.abs(got - want).max() / scale
    with pytest.raises(ValueError, match="tau weights"):
        jax.eval_shape(functools.partial(g.gemv_rows, tau_w=(wq[:8], wv[:8])), x, w1, b1)


def test_small_linear_pair_hands_padded_rows_only_to_callers_that_take_them(monkeypatch: pytest.MonkeyPatch):
    x = jnp.ones((1, 128), BF16)
    w1, w2 = jnp.ones((128, 192), BF16), jnp.ones((128, 64), BF16)
    b1, b2 = jnp.zeros((192,), BF16), jnp.zeros((64,), BF16)

    tau = TauWeights(jnp.ones((32, 192), BF16), jnp.ones((32, 192), BF16), jnp.zeros((32,), BF16))

    def shapes(padded_ok, b=b1, tau=None):  # traced only: the kernels cannot run un-interpreted on the CPU
        with ops.use_backend("kernel"):
            out = jax.eval_shape(lambda: ops.small_linear_pair(x, w1, b, w2, b2, max_rows=1, rows=1,
                                                               padded_ok=padded_ok, tau=tau))
        return [None if o is None else (o.dots.shape if isinstance(o, TauDots) else o.shape) for o in out]

    monkeypatch.delenv("KESTREL_JAX_GEMV_ROWS", raising=False)
    monkeypatch.delenv("KESTREL_JAX_TAU_DOTS", raising=False)
    assert shapes(True) == [(8, 192), (8, 64), None]  # gemv_rows: the row tile
    assert shapes(True, tau=tau) == [(8, 192), (8, 64), (3, 64, 8)]  # and the tau dots, per column block
    assert shapes(True, tau=tau._replace(wq=tau.wq[:16], wv=tau.wv[:16])) == [(8, 192), (8, 64), None]  # 16 heads
    assert shapes(False, tau=tau) == [(1, 192), (1, 64), None]  # gemv_pair: the real rows, no dots
    assert shapes(True, b=jnp.zeros((192,), jnp.float32)) == [(1, 192), (1, 64), None]  # not a bf16 bias
    monkeypatch.setenv("KESTREL_JAX_TAU_DOTS", "0")
    assert shapes(True, tau=tau) == [(8, 192), (8, 64), None]
    monkeypatch.setenv("KESTREL_JAX_GEMV_ROWS", "0")  # the A/B switch
    assert shapes(True) == [(1, 192), (1, 64), None]


def test_rows_kernel_stages_switch_reaches_the_kernel(monkeypatch: pytest.MonkeyPatch):
    """KESTREL_JAX_GEMV_ROWS_STAGES: the QKV + router rows kernel's ring depth (default the
    kernel's ROWS_STAGES); the products are the same at any depth (interpreted)."""
    rng = fresh_rng()
    x = jnp.asarray(rng.standard_normal((1, 256)), BF16)
    w1, w2 = (jnp.asarray(rng.standard_normal((256, n)), BF16) for n in (128, 64))
    b1, b2 = (jnp.asarray(rng.standard_normal((n,)), BF16) for n in (128, 64))
    seen: list[int] = []
    kernel = g.gemv_rows

    def interpreted(*args, stages, **kw):
        seen.append(stages)
        return kernel(*args, stages=stages, interpret=True, **kw)

    def run():
        with ops.use_backend("kernel"), monkeypatch.context() as m:
            m.setattr(g, "gemv_rows", interpreted)
            return ops.small_linear_pair(x, w1, b1, w2, b2, max_rows=1, rows=1, padded_ok=True)

    monkeypatch.delenv("KESTREL_JAX_GEMV_ROWS", raising=False)
    monkeypatch.delenv("KESTREL_JAX_GEMV_ROWS_STAGES", raising=False)
    assert ops.rows_gemv_stages() == g.ROWS_STAGES and ops.rows_gemv_stages(ln=True) == g.ROWS_STAGES_LN
    ref = run()
    monkeypatch.setenv("KESTREL_JAX_GEMV_ROWS_STAGES", "2")
    got = run()
    assert seen == [g.ROWS_STAGES, 2] and ops.rows_gemv_stages(ln=True) == 2  # (the switch sets both)
    for a, b in zip(ref[:2], got[:2], strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    monkeypatch.setenv("KESTREL_JAX_GEMV_ROWS_STAGES", "0")
    with pytest.raises(ValueError, match="KESTREL_JAX_GEMV_ROWS_STAGES must be an integer"):
        ops.rows_gemv_stages()


def test_gemv_partials_sum_to_the_product_and_pad_rows_are_zero():
    rng = fresh_rng()
    x = jnp.asarray(rng.standard_normal((5, 256)), BF16)
    w = jnp.asarray(rng.standard_normal((256, 128)), BF16)
    parts = np.asarray(jax.jit(functools.partial(g.gemv_partials, splits=4, interpret=True))(x, w))
    assert parts.shape == (4, 128, 8)  # [splits, N, M rounded up to 8]
    assert not np.any(parts[:, :, 5:]), "columns of padding rows must be zero"
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(parts.sum(0).T[:5], exact, rtol=0, atol=1e-3 * np.abs(exact).max())


@pytest.mark.parametrize("M,H,S", [(1, 4, 4), (3, 2, 3)])
def test_gemv_merged_is_the_merge_then_the_product(M: int, H: int, S: int):
    """`gemv_merged` (split-KV attention partials merged inside the GEMM's launch) gives the
    product of `merge_splits`' bf16 output bit for bit (interpreted), with an empty split (-inf
    log2-sum-exp2), an inactive row (every split empty: zeros) and NaN past the real rows."""
    from kestrel_jax.pallas.paged_attention_mgpu import merge_splits

    rng = fresh_rng()
    o = jnp.asarray(rng.standard_normal((8, H, S, 64)), jnp.float32).at[M:].set(jnp.nan)
    lse = jnp.asarray(rng.standard_normal((8, H, S)) * 4, jnp.float32).at[M:].set(jnp.nan)
    lse = lse.at[0, H - 1, S - 1].set(-jnp.inf)
    if M > 1:
        lse = lse.at[1].set(-jnp.inf)
    w = jnp.asarray(rng.standard_normal((H * 64, 128)) / 16, BF16)
    b = jnp.asarray(rng.standard_normal(128), BF16)
    got = jax.jit(functools.partial(g.gemv_merged, rows=M, interpret=True))(o, lse, w, b)
    x = merge_splits(o[:M], lse[:M], BF16).reshape(M, H * 64)
    want = jax.jit(functools.partial(g.gemv, interpret=True))(x, w, b)
    assert got.shape == (M, 128) and got.dtype == BF16 and np.isfinite(np.asarray(got, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    if M > 1:
        np.testing.assert_array_equal(np.asarray(got[1], np.float32), np.asarray(b, np.float32))
    parts = g.gemv_partials(None, w, merge=(o, lse, M), interpret=True)
    assert not np.asarray(parts[..., M:]).any()  # padding rows' products are zero, not NaN
    with pytest.raises(ValueError, match="merged-input gemv"):
        g.gemv_partials(None, w, merge=(o[:, :, :, :32], lse, M))
    with pytest.raises(ValueError, match="merged-input gemv"):  # a gate would be ignored: refused
        g.gemv_partials(None, w, merge=(o, lse, M), gate=g.Gate(jnp.ones((1, 1), jnp.int32), 0, 0))


def test_gemv_gate_skips_the_product_where_its_element_is_zero():
    """`gate` = Gate(array, row, column): 0 there and the product is skipped (just the bias, for the
    pair too); any other value and it is the ungated product bit for bit (interpreted)."""
    rng = fresh_rng()
    x = jnp.asarray(rng.standard_normal((3, 256)), BF16)
    w1 = jnp.asarray(rng.standard_normal((256, 128)) / 16, BF16)
    w2 = jnp.asarray(rng.standard_normal((256, 64)) / 16, BF16)
    b1 = jnp.asarray(rng.standard_normal(128), BF16)
    b2 = jnp.asarray(rng.standard_normal(64), BF16)
    plain = g.gemv(x, w1, b1, interpret=True)
    plain_pair = g.gemv_pair(x, w1, b1, w2, b2, interpret=True)
    for value in (0, 1, 7):
        arr = jnp.zeros((2, 5), jnp.int32).at[1, 3].set(value)
        got = g.gemv(x, w1, b1, gate=g.Gate(arr, 1, 3), interpret=True)
        pair = g.gemv_pair(x, w1, b1, w2, b2, gate=g.Gate(arr, 1, 3), interpret=True)
        if value:
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(plain, np.float32))
            for a, b in zip(pair, plain_pair, strict=True):
                np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        else:
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.broadcast_to(np.asarray(b1, np.float32),
                                                                                        (3, 128)))
            assert np.array_equal(np.asarray(pair[1], np.float32), np.broadcast_to(np.asarray(b2, np.float32), (3, 64)))


def test_gemv_refuses_what_it_cannot_do():
    z = jnp.zeros
    x, w = z((4, 256), BF16), z((256, 128), BF16)
    assert g.gemv_supported(x, w)
    assert not g.gemv_supported(z((65, 256), BF16), w)  # more rows than one wgmma N
    assert not g.gemv_supported(z((4, 200), BF16), z((200, 128), BF16))  # K not a multiple of 64
    assert not g.gemv_supported(x, z((256, 96), BF16))  # N not a multiple of 64
    assert not g.gemv_supported(x.astype(jnp.float32), w)
    assert not g.gemv_supported(x, z((128, 128), BF16))
    with pytest.raises(ValueError):
        jax.eval_shape(functools.partial(g.gemv, splits=3), x, w)  # 3 does not divide 4 K steps
    with pytest.raises(ValueError):
        jax.eval_shape(g.gemv, _SDS((4, 200), BF16), _SDS((200, 128), BF16))


def test_default_splits_fill_the_gpu_with_at_least_four_steps_each():
    # (K, N) -> splits: double while under 2 CTAs per SM (132 SMs) and each keeps >= 4 steps of 64 rows
    expected = {(2048, 2048): 8, (2048, 6144): 4, (2048, 64): 8, (8192, 2048): 16, (2048, 51200): 1}
    for (K, N), s in expected.items():
        assert g.default_splits(K, N) == s, (K, N)


def test_small_linear_dispatch():
    x, w, b = jnp.ones((2, 128), BF16), jnp.ones((128, 64), BF16), jnp.zeros((64,), BF16)
    with ops.use_backend("reference"):
        assert ops.small_linear(x, w, b, max_rows=8) is None
    with ops.use_backend("kernel"):
        assert ops.small_linear(x, w, b, max_rows=1) is None  # more rows than asked for
        assert ops.small_linear(x, jnp.ones((128, 96), BF16), None, max_rows=8) is None  # unsupported N



def test_kernel_row_limits_default_and_override(monkeypatch: pytest.MonkeyPatch):
    """The MoE layers' decode projections take the kernel up to 1 (QKV) and 8 (proj) rows unless
    the A/B variables say otherwise; a bad value is an error, not a silent default."""
    from kestrel_jax.models import text

    monkeypatch.delenv("KESTREL_JAX_GEMV_QKV_ROWS", raising=False)
    monkeypatch.delenv("KESTREL_JAX_GEMV_PROJ_ROWS", raising=False)
    assert (text.qkv_kernel_rows(), text.proj_kernel_rows()) == (text.QKV_KERNEL_ROWS, text.PROJ_KERNEL_ROWS)
    monkeypatch.setenv("KESTREL_JAX_GEMV_QKV_ROWS", "64")
    monkeypatch.setenv("KESTREL_JAX_GEMV_PROJ_ROWS", "0")
    assert (text.qkv_kernel_rows(), text.proj_kernel_rows()) == (64, 0)
    for bad in ("65", "-1", "eight"):
        monkeypatch.setenv("KESTREL_JAX_GEMV_QKV_ROWS", bad)
        with pytest.raises(ValueError, match="KESTREL_JAX_GEMV_QKV_ROWS"):
            text.qkv_kernel_rows()

def test_gemv_lowers_at_decoder_shapes():
    """Pallas -> Mosaic GPU lowering for an H100 (layout inference, SMEM, TMA/tiling legality), as
    tests/pallas/test_paged_attention.py does it; LLVM/ptxas run only on the GPU."""
    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    for M, K, N in [(1, 2048, 6144), (1, 2048, 2048), (8, 2048, 2048), (64, 2048, 2048), (3, 2048, 64)]:
        specs = (_SDS((M, K), BF16), _SDS((K, N), BF16), _SDS((N,), BF16))
        with jax.sharding.use_abstract_mesh(mesh):
            text = jax.jit(g.gemv).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text
    # MD2's joined dense decode products at 64 rows (KESTREL_JAX_GEMV_DENSE_IN / _OUT), with the
    # splits and ring depths the device runs try: [2048, 6144 + 8192] and [2048 + 8192, 2048]
    for K, N, splits, stages in [(2048, 14336, 1, 4), (2048, 14336, 2, 8), (10240, 2048, 4, 8),
                                 (10240, 2048, 8, 4), (10240, 2048, 16, 4)]:
        specs = (_SDS((64, K), BF16), _SDS((K, N), BF16), _SDS((N,), BF16))
        for row_major in (False, True):
            with jax.sharding.use_abstract_mesh(mesh):
                text = jax.jit(functools.partial(g.gemv, splits=splits, stages=stages, row_major=row_major)).trace(
                    *specs).lower(lowering_platforms=("cuda",)).as_text()
            assert "kestrel_gemv" in text
    # an MoE layer's QKV and router in one launch
    pair = (_SDS((1, 2048), BF16), _SDS((2048, 6144), BF16), _SDS((6144,), BF16), _SDS((2048, 64), BF16),
            _SDS((64,), BF16))
    with jax.sharding.use_abstract_mesh(mesh):
        assert "mosaic_gpu" in jax.jit(g.gemv_pair).trace(*pair).lower(lowering_platforms=("cuda",)).as_text()
    # the same as finished rows, at 1, 8 and 64 rows (the ring shortened to fit SMEM at 64)
    for M, early in ((1, False), (1, True), (8, False), (64, True)):
        rows_pair = (_SDS((M, 2048), BF16), *pair[1:])
        with jax.sharding.use_abstract_mesh(mesh):
            text = jax.jit(functools.partial(g.gemv_rows, bias_early=early)).trace(*rows_pair).lower(
                lowering_platforms=("cuda",)).as_text()
        assert "kestrel_gemv_rows" in text
    # a gated product (the region heads': MD3's paired decoders, gated on a step's int column)
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(g.gemv_pair).trace(
            _SDS((1, 2048), BF16), _SDS((2048, 1024), BF16), _SDS((1024,), BF16), _SDS((2048, 2048), BF16),
            _SDS((2048,), BF16), gate=g.Gate(_SDS((1, 40), jnp.int32), 0, 15)).lower(  # type: ignore[arg-type]
                lowering_platforms=("cuda",)).as_text()
    assert "kestrel_gemv" in text
    # the output projection with split-KV attention's merge inside (MD3: 32 heads, 4 splits at 1 row)
    for M in (1, 8):
        with jax.sharding.use_abstract_mesh(mesh):
            text = jax.jit(functools.partial(g.gemv_merged, rows=M)).trace(
                _SDS((8, 32, 4, 64), jnp.float32), _SDS((8, 32, 4), jnp.float32), _SDS((2048, 2048), BF16),
                _SDS((2048,), BF16)).lower(lowering_platforms=("cuda",)).as_text()
        assert "kestrel_gemv" in text
    # with MD3's tau dots (32 heads over the 6,144-wide QKV row), at 1, 8 and 64 rows
    tw = (_SDS((32, 6144), BF16), _SDS((32, 6144), BF16))
    for M in (1, 8, 64):
        with jax.sharding.use_abstract_mesh(mesh):
            text = jax.jit(lambda x, w1, b1, w2, b2, wq, wv: g.gemv_rows(x, w1, b1, w2, b2, tau_w=(wq, wv))).trace(
                _SDS((M, 2048), BF16), *pair[1:], *tw).lower(lowering_platforms=("cuda",)).as_text()
        assert "kestrel_gemv_rows" in text
