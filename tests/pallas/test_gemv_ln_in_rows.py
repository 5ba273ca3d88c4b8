"""The decode GEMM's rows kernel with the LayerNorm inside (`gemv_mgpu.gemv_rows(ln=...)`, the
KESTREL_JAX_LN_IN_ROWS, on by default): interpreted on the CPU against `ln_rows_ref` and against the rows
kernel fed the normalised rows, its refusals, its dispatch in `ops.decode_ln_qkv_router`, and the
Mosaic lowering for an H100 at an MoE layer's shapes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType
from kernel_helpers import as_f32, fresh_rng

from kestrel_jax.pallas import gemv_mgpu as g
from kestrel_jax.pallas import moe_mgpu, ops
from kestrel_jax.pallas.moe import ExpertWeights

BF16 = jnp.bfloat16
_SDS = jax.ShapeDtypeStruct


def _operands(rng: np.random.Generator, M: int, K: int, n1: int, n2: int | None):
    # rows far from zero mean with a wide spread, a scale around 1: a one-pass variance's cancellation
    # and a wrong row's statistics both show
    x = jnp.asarray(rng.standard_normal((M, K)) * rng.uniform(0.5, 4.0, (M, 1)) + rng.uniform(-2, 2, (M, 1)), BF16)
    scale = jnp.asarray(rng.uniform(0.5, 1.5, K), BF16)
    bias = jnp.asarray(rng.standard_normal(K) * 0.1, BF16)
    ws = [jnp.asarray(rng.standard_normal((K, n)) * 0.05, BF16) for n in (n1, n2) if n]
    bs = [jnp.asarray(rng.standard_normal((w.shape[1],)), BF16) for w in ws]
    return x, scale, bias, ws, bs


@pytest.mark.parametrize("K,N2,ahead", [(384, 64, False), (2048, None, False), (384, 64, True)])
def test_rows_kernel_normalises_its_input_as_the_layer_norm(K: int, N2: int | None, ahead: bool):
    """Every CTA normalises x itself: the appended rows are `ln_rows_ref`'s within one bf16 rounding
    (the f32 sums run in another order), padded with exact zeros to 8; the products are the rows
    kernel's on those normalised rows, bit for bit (the same x tiles reach the same MMAs), whether
    each step forms its x tile (the default) or every tile is formed ahead (`ln_tiles_ahead`)."""
    rng = fresh_rng()
    M = 1
    x, scale, bias, ws, bs = _operands(rng, M, K, 192, N2)
    args = (x, ws[0], bs[0]) if N2 is None else (x, ws[0], bs[0], ws[1], bs[1])
    *ys, n = jax.jit(functools.partial(g.gemv_rows, stages=3, interpret=True, ln=(scale, bias), ln_eps=1e-5,
                                       ln_tiles_ahead=ahead))(*args)
    assert n.shape == (8, K) and n.dtype == BF16 and len(ys) == len(ws)
    want = as_f32(g.ln_rows_ref(x, scale, bias, 1e-5))
    got = as_f32(n)
    assert not got[M:].any()
    # one bf16 last place apart at most, at the value's magnitude (near zero: at 2^-6 of the largest's).
    # (Written before as 2^-8 of the magnitude, under one last place in the lower part of each binade:
    # CI seed 1561298777 gave 0.10058594 against 0.100097656, one last place, 2^-11.)
    mag = np.maximum(np.abs(want), 2.0**-6 * np.abs(want).max())
    assert (np.abs(got - want) <= 2.0 ** (np.floor(np.log2(mag)) - 7)).all()
    plain = jax.jit(functools.partial(g.gemv_rows, stages=3, interpret=True))(n[:M], *args[1:])
    for y, p in zip(ys, plain, strict=True):
        assert y.shape == p.shape == (8, p.shape[1])
        np.testing.assert_array_equal(as_f32(y), as_f32(p))


def test_rows_kernel_with_layer_norm_and_tau_dots():
    """With MD3's tau weights too: the dots follow the appended normalised rows' products as without
    the LayerNorm (`gemv_rows(tau_w=...)` on those rows), the normalised rows last."""
    rng = fresh_rng()
    M, K, N1, H = 1, 1024, 192, g.TAU_ROWS // 2
    x, scale, bias, ws, bs = _operands(rng, M, K, N1, 64)
    wq, wv = (jnp.asarray(rng.standard_normal((H, N1)) * 0.05, BF16) for _ in range(2))
    run = functools.partial(g.gemv_rows, stages=2, interpret=True, tau_w=(wq, wv))
    y1, y2, dots, n = jax.jit(functools.partial(run, ln=(scale, bias), ln_eps=1e-5))(x, ws[0], bs[0], ws[1], bs[1])
    p1, p2, pdots = jax.jit(run)(n[:M], ws[0], bs[0], ws[1], bs[1])
    for a, b in ((y1, p1), (y2, p2), (dots, pdots)):
        np.testing.assert_array_equal(as_f32(a), as_f32(b))
    assert not as_f32(n)[M:].any()


@pytest.mark.parametrize("shape,dtypes,match", [
    ((2, 1024), (BF16, BF16), "one row"),
    ((1, 960), (BF16, BF16), "multiples of 128"),
    ((1, 1024), (jnp.float32, BF16), "float32"),
    ((1, 1024), (BF16, jnp.float32), "float32"),
])
def test_rows_kernel_refuses_a_layer_norm_it_cannot_form(shape, dtypes, match):
    x = jnp.zeros(shape, dtypes[0])
    K = shape[1]
    scale = jnp.ones((K,), dtypes[1])
    w = jnp.zeros((K, 64), BF16)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(functools.partial(g.gemv_rows, ln=(scale, scale.astype(BF16))), x, w, None)
    with pytest.raises(ValueError, match=r"scale \(128,\)"):  # a scale of another width
        jax.eval_shape(functools.partial(g.gemv_rows, ln=(jnp.ones((128,), BF16), jnp.ones((1024,), BF16))),
                       jnp.zeros((1, 1024), BF16), jnp.zeros((1024, 64), BF16), None)


def _off_when_asked_then_default(call, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`call()` is None with switch `name` at 0, and unset (on by default) off the kernel path;
    leaves it unset."""
    monkeypatch.setenv(name, "0")
    with ops.use_backend("kernel"):
        assert call() is None  # switched off
    monkeypatch.delenv(name)
    with ops.use_backend("reference"):
        assert call() is None


def test_decode_ln_qkv_router_dispatch(monkeypatch: pytest.MonkeyPatch):
    """`ops.decode_ln_qkv_router` takes the rows kernel with the LayerNorm unless switched off
    (KESTREL_JAX_LN_IN_ROWS 1 by default, or `ahead` for the tiles formed before the first MMA), on the kernel
    path, for shapes it takes (one row), with the rows kernel and the LayerNorm kernel on, and not
    where the expert GEMMs want f16 rows; then it hands back the kernel's outputs as (QKV rows,
    router rows, dots, normalised rows)."""
    seen: list[tuple] = []

    def fake(x, w1, b1, w2=None, b2=None, *, ln=None, ln_eps=None, tau_w=None, stages=None, ln_tiles_ahead=None):
        seen.append((x.shape, ln is not None, ln_eps, tau_w is not None, stages, ln_tiles_ahead))
        pad = 8 - x.shape[0]
        return (jnp.pad(x @ w1, ((0, pad), (0, 0))), jnp.pad(x @ w2, ((0, pad), (0, 0))),
                jnp.pad(x, ((0, pad), (0, 0))))

    monkeypatch.setattr(g, "gemv_rows", fake)
    monkeypatch.setattr(g, "gemv_supported", lambda x, w: True)
    ops._jitted.cache_clear()
    K = 1024
    experts = ExpertWeights(jnp.zeros((4, 512, K), jnp.float8_e4m3fn), jnp.zeros((4, K, 256), jnp.float8_e4m3fn),
                            jnp.ones((4, 512), jnp.float32), jnp.ones((4, K), jnp.float32))
    x, scale, bias = jnp.ones((1, K), BF16), jnp.ones((K,), BF16), jnp.zeros((K,), BF16)
    w1, w2 = jnp.ones((K, 192), BF16), jnp.ones((K, 64), BF16)

    def call(x=x, scale=scale):
        return ops.decode_ln_qkv_router(x, scale, bias, w1, None, w2, None, experts, eps=1e-6, max_rows=64)

    _off_when_asked_then_default(call, "KESTREL_JAX_LN_IN_ROWS", monkeypatch)
    with ops.use_backend("kernel"):
        out = call()
        assert out is not None and [o.shape for o in out if o is not None] == [(8, 192), (8, 64), (8, K)]
        assert out[2] is None
        assert seen == [((1, K), True, 1e-6, False, g.ROWS_STAGES_MOE_LN, False)]  # the MoE LN kernel's ring
        monkeypatch.setenv("KESTREL_JAX_LN_IN_ROWS", "ahead")  # the x tiles formed before the first MMA
        assert call() is not None and seen[-1][-1] is True
        seen.pop()
        monkeypatch.setenv("KESTREL_JAX_LN_IN_ROWS", "1")
        assert call(x=jnp.ones((2, K), BF16)) is None  # one row only
        assert call(scale=jnp.ones((K,), jnp.float32)) is None  # a scale the kernel refuses
        for name in ("KESTREL_JAX_GEMV_ROWS", "KESTREL_JAX_LN_KERNEL"):
            monkeypatch.setenv(name, "0")
            assert call() is None, name
            monkeypatch.delenv(name)
        monkeypatch.setenv("KESTREL_JAX_W8A8_MIN_TOKENS", "2")  # W8A16 at one row: the experts read f16 rows
        assert moe_mgpu.f16_rows_wanted(1, experts)
        assert call() is None
    assert len(seen) == 1


def test_decode_ln_qkv_router_ring_switches(monkeypatch: pytest.MonkeyPatch):
    """The MoE QKV + router rows kernel runs its own ring depth (ROWS_STAGES_MOE_LN), set alone by
    KESTREL_JAX_GEMV_ROWS_STAGES_MOE; KESTREL_JAX_GEMV_ROWS_STAGES alone still sets every rows
    kernel's, this one's included; the dense LayerNorm rows kernels keep ROWS_STAGES_LN."""
    seen: list[dict] = []

    def fake(x, w1, b1, w2=None, b2=None, **kw):
        seen.append(kw)
        pad = 8 - x.shape[0]
        return (jnp.pad(x @ w1, ((0, pad), (0, 0))), jnp.pad(x @ w2, ((0, pad), (0, 0))),
                jnp.pad(x, ((0, pad), (0, 0))))

    monkeypatch.setattr(g, "gemv_rows", fake)
    monkeypatch.setattr(g, "gemv_supported", lambda x, w: True)
    for name in ("KESTREL_JAX_GEMV_ROWS_STAGES", "KESTREL_JAX_GEMV_ROWS_STAGES_MOE", "KESTREL_JAX_LN_IN_ROWS"):
        monkeypatch.delenv(name, raising=False)
    K = 1024
    experts = ExpertWeights(jnp.zeros((4, 512, K), jnp.float8_e4m3fn), jnp.zeros((4, K, 256), jnp.float8_e4m3fn),
                            jnp.ones((4, 512), jnp.float32), jnp.ones((4, K), jnp.float32))
    x, scale, bias = jnp.ones((1, K), BF16), jnp.ones((K,), BF16), jnp.zeros((K,), BF16)
    w1, w2 = jnp.ones((K, 192), BF16), jnp.ones((K, 64), BF16)

    def call():
        ops._jitted.cache_clear()
        assert ops.decode_ln_qkv_router(x, scale, bias, w1, None, w2, None, experts, eps=1e-6, max_rows=64) is not None
        return seen[-1]["stages"]

    assert g.ROWS_STAGES_MOE_LN != g.ROWS_STAGES_LN  # (else this test shows nothing)
    with ops.use_backend("kernel"):
        assert call() == g.ROWS_STAGES_MOE_LN and ops.rows_gemv_stages(ln=True) == g.ROWS_STAGES_LN
        monkeypatch.setenv("KESTREL_JAX_GEMV_ROWS_STAGES", "5")
        assert call() == 5 and ops.rows_gemv_stages(ln=True) == 5 and ops.rows_gemv_stages() == 5
        monkeypatch.setenv("KESTREL_JAX_GEMV_ROWS_STAGES_MOE", "12")
        assert call() == 12 and ops.rows_gemv_stages(ln=True) == 5
        monkeypatch.delenv("KESTREL_JAX_GEMV_ROWS_STAGES")
        assert call() == 12 and ops.rows_gemv_stages(ln=True) == g.ROWS_STAGES_LN
        monkeypatch.setenv("KESTREL_JAX_GEMV_ROWS_STAGES_MOE", "0")
        with pytest.raises(ValueError, match="KESTREL_JAX_GEMV_ROWS_STAGES_MOE must be an integer"):
            call()


def test_rows_kernel_with_layer_norm_lowers_at_an_moe_layers_shapes():
    """Mosaic GPU lowering for an H100 (layout inference, SMEM, TMA legality) of an MoE layer's QKV +
    router product with its LayerNorm, at one row, with and without MD3's tau dots, the x tiles
    formed step by step and ahead."""
    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    pair = (_SDS((2048, 6144), BF16), _SDS((6144,), BF16), _SDS((2048, 64), BF16), _SDS((64,), BF16))
    tw = (_SDS((32, 6144), BF16), _SDS((32, 6144), BF16))
    ln = (_SDS((2048,), BF16), _SDS((2048,), BF16))
    for M, tau, ahead in ((1, True, False), (1, False, False), (1, True, True)):
        def f(x, w1, b1, w2, b2, wq, wv, sc, sh, tau=tau, ahead=ahead):
            return g.gemv_rows(x, w1, b1, w2, b2, tau_w=(wq, wv) if tau else None, ln=(sc, sh), ln_eps=1e-5,
                               ln_tiles_ahead=ahead)

        with jax.sharding.use_abstract_mesh(mesh):
            text = jax.jit(f).trace(_SDS((M, 2048), BF16), *pair, *tw, *ln).lower(
                lowering_platforms=("cuda",)).as_text()
        assert "kestrel_gemv_rows" in text


def test_decode_ln_dense_in_dispatch(monkeypatch: pytest.MonkeyPatch):
    """`ops.decode_ln_dense_in` takes the rows kernel with the LayerNorm over a dense layer's joined
    weight unless switched off (KESTREL_JAX_DENSE_LN_IN_ROWS=0), on the kernel path, at one row, with
    the rows kernel on, for a LayerNorm the kernel takes; the tiles' order follows
    KESTREL_JAX_LN_IN_ROWS (`ahead`); it hands back (product rows, normalised rows)."""
    seen: list[tuple] = []
    rings: list[int] = []

    def fake(x, w1, b1, w2=None, b2=None, *, ln=None, ln_eps=None, tau_w=None, stages=None, ln_tiles_ahead=None):
        seen.append((x.shape, w1.shape, w2 is None, ln is not None, ln_eps, ln_tiles_ahead))
        rings.append(stages)
        return jnp.pad(x @ w1, ((0, 7), (0, 0))), jnp.pad(x, ((0, 7), (0, 0)))

    monkeypatch.setattr(g, "gemv_rows", fake)
    monkeypatch.setattr(g, "gemv_supported", lambda x, w: True)
    ops._jitted.cache_clear()
    K, N = 1024, 448
    x, scale, bias = jnp.ones((1, K), BF16), jnp.ones((K,), BF16), jnp.zeros((K,), BF16)
    w, b = jnp.ones((K, N), BF16), jnp.zeros((N,), BF16)

    def call(x=x, scale=scale):
        return ops.decode_ln_dense_in(x, scale, bias, w, b, eps=1e-6)

    _off_when_asked_then_default(call, "KESTREL_JAX_DENSE_LN_IN_ROWS", monkeypatch)
    with ops.use_backend("kernel"):
        out = call()
        assert out is not None and [o.shape for o in out] == [(8, N), (8, K)]
        assert seen == [((1, K), (K, N), True, True, 1e-6, False)] and rings == [g.ROWS_STAGES_LN]
        monkeypatch.setenv("KESTREL_JAX_LN_IN_ROWS", "ahead")
        assert call() is not None and seen[-1][-1] is True
        monkeypatch.delenv("KESTREL_JAX_LN_IN_ROWS")
        n_seen = len(seen)
        assert call(x=jnp.ones((2, K), BF16)) is None  # one row only
        assert call(scale=jnp.ones((K,), jnp.float32)) is None  # a scale the kernel refuses
        monkeypatch.setenv("KESTREL_JAX_GEMV_ROWS", "0")
        assert call() is None
        assert len(seen) == n_seen


def test_rows_kernel_with_layer_norm_lowers_at_dense_layers_shapes():
    """Mosaic GPU lowering for an H100 of a dense layer's joined QKV + fc1 product with its
    LayerNorm at one row (224 CTAs of 64 columns: two waves on 132 SMs)."""
    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)

    def f(x, w, b, sc, sh):
        return g.gemv_rows(x, w, b, ln=(sc, sh), ln_eps=1e-5)

    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(f).trace(_SDS((1, 2048), BF16), _SDS((2048, 14336), BF16), _SDS((14336,), BF16),
                                _SDS((2048,), BF16), _SDS((2048,), BF16)).lower(lowering_platforms=("cuda",)).as_text()
    assert "kestrel_gemv_rows" in text
