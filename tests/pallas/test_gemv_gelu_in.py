"""The decode GEMM kernel forming a dense layer's joined output + fc2 input row itself
(`gemv_mgpu.gemv_partials(gelu_in=...)`, `gemv_gelu_in`, the opt-in KESTREL_JAX_DENSE_OUT_GELU_IN):
interpreted on the CPU against `gemv_gelu_in_ref` and against the kernel on the row XLA forms, its
GELU formula, its refusals, the choice of K ranges, its dispatch in `ops.dense_out_gelu_in`, and
the Mosaic lowering for an H100 at Moondream's shapes."""

from __future__ import annotations

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


@pytest.mark.parametrize("ko,kh,n,splits,h_col", [(256, 768, 128, 4, 0), (256, 512, 192, 6, 192),
                                                 (128, 640, 64, 6, 64)])
def test_kernel_forms_its_row_from_o_and_the_fc1_columns(ko: int, kh: int, n: int, splits: int, h_col: int):
    """The product of the row [o, GELU_tanh(h[0, h_col:h_col + kh])]: within bf16 rounding of the
    f32 reference (`gemv_gelu_in_allowance`: the row's GELU values may each round to the
    neighbouring bf16, the output's two roundings) and bit for bit the kernel's product on that row
    formed outside it (with the kernel's GELU formula) and padded to 8 rows, whatever the rows of h
    past the first hold (NaN here) and the columns before h_col; one row of output, finite."""
    rng = fresh_rng()
    o = jnp.asarray(rng.standard_normal((1, ko)) * rng.uniform(0.2, 2.0), BF16)
    hw = rng.standard_normal((8, h_col + kh + 64)) * rng.uniform(0.5, 4.0)
    hw[1:] = np.nan  # rows the kernel must not read
    hw[0, :h_col] = np.nan  # the QKV columns before fc1's
    h = jnp.asarray(hw, BF16)
    w = jnp.asarray(rng.standard_normal((ko + kh, n)) / np.sqrt(ko + kh), BF16)
    b = jnp.asarray(rng.standard_normal(n) * 0.1, BF16)
    assert g.gelu_in_problem(o, h, w, splits, h_col) is None
    got = as_f32(g.gemv_gelu_in(o, h, w, b, splits=splits, h_col=h_col, interpret=True))
    want = as_f32(g.gemv_gelu_in_ref(o, h, w, b, h_col=h_col))
    assert got.shape == (1, n) and np.isfinite(got).all()
    assert (np.abs(got - want) <= g.gemv_gelu_in_allowance(o, h, w, b, jnp.asarray(want), h_col)).all()
    row = jnp.concatenate([o, g.gelu_tanh_exp(h[:1, h_col:h_col + kh].astype(jnp.float32)).astype(BF16)], axis=1)
    same = as_f32(g.gemv(row, w, b, splits=splits, interpret=True))
    np.testing.assert_array_equal(got, same)


def test_gelu_formula_without_tanh():
    """`gelu_tanh_exp` is GELU's tanh approximation (float64 reference) to f32 accuracy (the
    exponent's rounding allowed for), finite and signed correctly far out on both sides."""
    x = np.concatenate([np.linspace(-12, 12, 4001), [-90.0, -40.0, 40.0, 90.0]]).astype(np.float32)
    got = np.asarray(g.gelu_tanh_exp(jnp.asarray(x)), np.float64)
    xd = x.astype(np.float64)
    z = np.sqrt(2 / np.pi) * (xd + 0.044715 * xd**3)
    with np.errstate(over="ignore"):
        want = xd / (1 + np.exp(-2 * z))  # 0.5 (1 + tanh z) without its cancellation, in float64
    near = np.abs(xd) <= 5
    np.testing.assert_allclose(want[near], 0.5 * xd[near] * (1 + np.tanh(z[near])), rtol=1e-9, atol=1e-12)
    assert np.isfinite(got).all()
    # f32's rounding of the exponent -2 z costs |2 z| ulps of exp's result far out
    assert (np.abs(got - want) <= 1e-6 * (1 + np.abs(2 * z)) * np.abs(want) + 1e-37).all()
    assert got[-1] == 90.0 and got[-4] <= 0.0


def test_refusals_and_splits():
    """Shapes the kernel refuses, with the reason, and `gemv_partials` raising on them; the fewest
    K ranges that keep each inside o or h (Moondream's 2,048 + 8,192 at 4 or more: 5)."""
    o, h, w = _SDS((1, 256), BF16), _SDS((8, 1024), BF16), _SDS((1024, 128), BF16)
    assert g.gelu_in_problem(o, h, w, 4) is None
    assert "one row" in str(g.gelu_in_problem(_SDS((2, 256), BF16), h, w, 4))
    assert "bf16" in str(g.gelu_in_problem(o, _SDS((8, 1024), jnp.float32), w, 4))
    assert "do not fit" in str(g.gelu_in_problem(o, h, w, 4, h_col=320))  # h's columns run out
    assert "do not fit" in str(g.gelu_in_problem(o, _SDS((8, 2048), BF16), w, 4, h_col=32))  # unaligned column
    assert "divide" in str(g.gelu_in_problem(o, h, w, 3))
    assert "inside o" in str(g.gelu_in_problem(o, h, w, 2))  # 512-column ranges straddle o's 256
    assert g.gelu_in_splits(2048, 10240, 4) == 5
    assert g.gelu_in_splits(256, 768, 4) == 6
    assert g.gelu_in_splits(2048, 10240, 6) == 10
    assert g.gelu_in_splits(96, 192, 1) == 0
    with pytest.raises(ValueError, match="gelu_in"):
        g.gemv_gelu_in(jnp.zeros((1, 256), BF16), jnp.zeros((8, 1024), BF16), jnp.zeros((1024, 128), BF16),
                       splits=2, interpret=True)
    with pytest.raises(ValueError, match="beside it"):
        g.gemv_partials(jnp.zeros((1, 1024), BF16), jnp.zeros((1024, 128), BF16), splits=4,
                        gelu_in=(jnp.zeros((1, 256), BF16), jnp.zeros((8, 1024), BF16), 0), interpret=True)


def test_lowers_at_moondreams_shapes():
    """Mosaic GPU lowering for an H100 (layout inference, SMEM, TMA legality) of a dense layer's
    joined output + fc2 product with its row formed inside: o [1, 2048], the joined QKV + fc1
    product [8, 14336] read from column 6144, w [10240, 2048], 5 K ranges, 8 stages."""
    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)

    def f(o, h, w, b):
        return g.gemv_gelu_in(o, h, w, b, splits=5, h_col=6144, stages=8)

    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(f).trace(_SDS((1, 2048), BF16), _SDS((8, 14336), BF16), _SDS((10240, 2048), BF16),
                                _SDS((2048,), BF16)).lower(lowering_platforms=("cuda",)).as_text()
    assert "kestrel_gemv" in text


def test_dispatch(monkeypatch: pytest.MonkeyPatch):
    """`ops.dense_out_gelu_in` takes the kernel only where asked (KESTREL_JAX_DENSE_OUT_GELU_IN=1),
    on the kernel path, at one row, with the joined product on the kernel (a nonzero
    `dense_out_splits`), in the fewest K ranges at least those that keep each inside o or h, and
    hands back its row."""
    seen: list[tuple] = []

    def fake(o, h, w, b=None, *, splits, h_col=0, stages=4):
        seen.append((o.shape, h.shape, w.shape, splits, h_col, stages))
        return jnp.zeros((1, w.shape[1]), BF16)

    monkeypatch.setattr(g, "gemv_gelu_in", fake)
    ops._jitted.cache_clear()
    o, h = jnp.ones((1, 256), BF16), jnp.ones((8, 192 + 512), BF16)
    w, b = jnp.ones((768, 128), BF16), jnp.zeros((128,), BF16)

    def call(o=o, h=h, w=w):
        return ops.dense_out_gelu_in(o, h, 192, w, b)

    monkeypatch.delenv("KESTREL_JAX_DENSE_OUT_GELU_IN", raising=False)
    with ops.use_backend("kernel"):
        assert call() is None  # off by default
    monkeypatch.setenv("KESTREL_JAX_DENSE_OUT_GELU_IN", "1")
    with ops.use_backend("reference"):
        assert call() is None
    with ops.use_backend("kernel"):
        out = call()
        assert out is not None and out.shape == (1, 128)
        assert seen == [((1, 256), (8, 704), (768, 128), 6, 192, ops.dense_decode_gemv()[2])]
        assert call(o=jnp.ones((2, 256), BF16)) is None  # one row only
        assert call(h=jnp.ones((8, 192 + 256), BF16)) is None  # fc1's columns run out
        monkeypatch.setenv("KESTREL_JAX_GEMV_DENSE_OUT_ONE_ROW", "0")  # the joined product on XLA
        assert call() is None
    assert len(seen) == 1
