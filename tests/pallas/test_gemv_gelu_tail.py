"""A dense layer's one-row joined output + fc2 product with its input formed inside the decode GEMM
kernel (`gemv_mgpu.gemv_partials(merge=..., gelu_tail=...)`, KESTREL_JAX_DENSE_OUT_MERGED): split-KV
attention's row 0 merged and GELU(fc1's row 0), concatenated and padded to 8 rows, with no launch
of their own. Interpreted on the CPU against `dense_out_input_ref` (the input, recovered exactly
through one-hot weights) and an f64 product; poisoned padding rows; refusals; the Mosaic lowering
for an H100 at MD2's shapes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType
from kernel_helpers import fresh_rng

from kestrel_jax.pallas import gemv_mgpu as g

BF16 = jnp.bfloat16
_SDS = jax.ShapeDtypeStruct


def _operands(rng: np.random.Generator, H: int, S: int, col0: int, kt: int):
    """Attention partials (rows 1.. and h's rows 1.. poisoned with NaN: only row 0 is real) and the
    joined product's fc1 rows h [8, col0 + kt] (the QKV columns before col0)."""
    o = jnp.asarray(rng.standard_normal((8, H, S, 64)), jnp.float32).at[1:].set(jnp.nan)
    lse = jnp.asarray(rng.standard_normal((8, H, S)) * 4, jnp.float32).at[1:].set(jnp.nan)
    lse = lse.at[0, H - 1, S - 1].set(-jnp.inf)  # an empty split: weight 0
    h = jnp.asarray(rng.standard_normal((8, col0 + kt)) * 2, BF16).at[1:].set(jnp.nan)
    return o, lse, h


def _run(o, lse, h, col0, w, splits):
    return jax.jit(functools.partial(g.gemv_partials, None, merge=(o, lse, 1), gelu_tail=(h, col0), splits=splits,
                                     stages=2, row0=True, interpret=True))(w)


@pytest.mark.parametrize("H,S,splits,col0,kt", [(4, 2, 2, 192, 256), (4, 3, 4, 64, 256), (2, 4, 1, 8, 192)])
def test_the_kernel_forms_the_merged_row_and_the_gelu_tail(H: int, S: int, splits: int, col0: int, kt: int):
    """Through one-hot weights (column n of w picks input element k_n, exact in f32) the kernel's
    input row is `dense_out_input_ref`'s, bit for bit but for GELU values one bf16 rounding apart
    (a tanh evaluated in another order), and the partials' sum is the f64 product of that row."""
    rng = fresh_rng()
    o, lse, h = _operands(rng, H, S, col0, kt)
    K = H * 64 + kt
    want = np.asarray(g.dense_out_input_ref(o, lse, h, col0), np.float32)[0]
    assert np.isfinite(want).all()
    picks = np.concatenate([rng.permutation(K), rng.integers(0, K, (-K) % 64)])  # every k, N a multiple of 64
    onehot = jnp.asarray(np.eye(K, dtype=np.float32)[:, picks], BF16)
    parts = np.asarray(_run(o, lse, h, col0, onehot, splits))
    assert parts.shape == (splits, picks.size) and np.isfinite(parts).all()
    got = parts.sum(0)
    heads = H * 64
    np.testing.assert_array_equal(got[picks < heads], want[picks[picks < heads]])
    tail = picks >= heads
    off = np.abs(got[tail] - want[picks[tail]])
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want[picks[tail]]), 2.0**-126))) - 7)
    near_zero = np.abs(np.asarray(h[0, col0:], np.float32))[picks[tail] - heads] * 2.0**-22  # 1 + tanh ~ 0
    assert (off <= ulp + near_zero).all() and (off == 0).mean() >= 0.95
    # the reference's GELU is the tanh form of fc1's bf16 row rounded once: within one bf16 rounding
    # of the f64 value, plus f32's cancellation in 1 + tanh where GELU nears zero (x << 0); jax.nn.gelu
    # on a bf16 array rounds its intermediates on the CPU, and is further off
    xt = np.asarray(h[0, col0:], np.float64)
    exact = 0.5 * xt * (1 + np.tanh(np.sqrt(2 / np.pi) * (xt + 0.044715 * xt**3)))
    ref_tail = want[heads:]
    half_ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(exact), 2.0**-126))) - 8)
    assert (np.abs(ref_tail - exact) <= half_ulp * 1.01 + np.abs(xt) * 2.0**-22).all()
    # a random product: the f64 product of the reference row
    w = jnp.asarray(rng.standard_normal((K, 128)) / 16, BF16)
    y = np.asarray(_run(o, lse, h, col0, w, splits)).sum(0)
    exact = want.astype(np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(y, exact, rtol=0, atol=2e-2 * np.abs(exact).max())


def test_a_mutated_tail_fails():
    """The f64 comparison above can fail: against the reference over fc1's columns 64 earlier the
    kernel's product differs."""
    rng = fresh_rng()
    H, S, col0, kt = 2, 2, 128, 128
    o, lse, h = _operands(rng, H, S, col0, kt)
    w = jnp.asarray(rng.standard_normal((H * 64 + kt, 64)) / 16, BF16)
    got = np.asarray(_run(o, lse, h, col0, w, 2)).sum(0)
    for c, h_ref in ((col0, h), (col0 - 64, h[:, :-64])):
        want = np.asarray(g.dense_out_input_ref(o, lse, h_ref, c), np.float64)[0] @ np.asarray(w, np.float64)
        assert (np.abs(got - want).max() <= 2e-2 * np.abs(want).max()) == (c == col0)


def test_refusals():
    o, lse = jnp.zeros((8, 4, 2, 64), jnp.float32), jnp.zeros((8, 4, 2), jnp.float32)
    h, w = jnp.zeros((8, 320), BF16), jnp.zeros((512, 64), BF16)

    def call(**kw):
        args = {"merge": (o, lse, 1), "gelu_tail": (h, 64), "splits": 2, "row0": True, **kw}
        jax.eval_shape(lambda w: g.gemv_partials(None, w, **args), w)

    call()  # accepted as given
    with pytest.raises(ValueError, match="need to divide the 4 heads"):
        call(splits=8)
    with pytest.raises(ValueError, match="need to divide the 4 heads"):
        call(splits=3)
    with pytest.raises(ValueError, match="need bf16 \\[576"):
        call(gelu_tail=(h, 0))  # 320 fc1 columns: K would be 576
    with pytest.raises(ValueError, match="a multiple of 64 of them"):
        call(gelu_tail=(h, 100))
    with pytest.raises(ValueError, match="one merged row only"):
        call(merge=(o, lse, 2))
    with pytest.raises(ValueError, match="gelu_tail needs `merge`"):
        jax.eval_shape(lambda x, w: g.gemv_partials(x, w, gelu_tail=(h, 64), splits=2), jnp.zeros((1, 512), BF16), w)


def test_lowers_at_md2_shapes():
    """Mosaic GPU lowering for an H100: MD2's joined output + fc2 product ([2048 + 8192, 2048], 32
    heads of split-KV partials in 4 splits, fc1's 8,192 columns from column 6,144 of the joined QKV +
    fc1 rows [8, 14336]), row-0 partials in 4 interleaved K ranges."""
    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)

    def run(o, lse, h, w):
        return g.gemv_partials(None, w, merge=(o, lse, 1), gelu_tail=(h, 6144), splits=4, stages=8, row0=True)

    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(run).trace(_SDS((8, 32, 4, 64), jnp.float32), _SDS((8, 32, 4), jnp.float32),
                                  _SDS((8, 14336), BF16), _SDS((10240, 2048), BF16)).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "kestrel_gemv" in text


def test_no_races_interpreted():
    """The interpreter's race detector finds none: the tiles formed after the ring's fill is issued,
    then committed, before the first MMA reads them."""
    from kestrel_jax.pallas.paged_attention_mgpu import interpret_races_found

    rng = fresh_rng()
    o, lse, h = _operands(rng, 4, 2, 192, 256)
    w = jnp.asarray(rng.standard_normal((4 * 64 + 256, 128)) / 16, BF16)
    out = g.gemv_partials(None, w, merge=(o, lse, 1), gelu_tail=(h, 192), splits=2, stages=2, row0=True,
                          interpret=True, detect_races=True)
    assert np.isfinite(np.asarray(out)).all()
    assert not interpret_races_found()
