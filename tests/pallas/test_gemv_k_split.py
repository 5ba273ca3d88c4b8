"""`gemv_mgpu.gemv_rows(k_split=...)`: each column block a cluster of CTAs that split K, CTA 0 adding
the others' partial blocks (handed over through global memory behind a cluster barrier) before its
epilogue. Interpreted on the CPU (clusters of 2: the interpreter runs a cluster's CTAs as threads,
and larger clusters starve CI's two cores) against the unsplit kernel and an f32 reference, with the
LayerNorm, an MoE layer's residual and MD3's tau dots inside; refusals. (The Mosaic lowering for an
H100 at MD3's shapes in clusters of 2 and 4: `test_gemv_residual.test_moe_residual_lowers_at_md3_shapes`.)"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import as_f32, fresh_rng

from kestrel_jax.pallas import gemv_mgpu as g

BF16 = jnp.bfloat16
_SDS = jax.ShapeDtypeStruct


def _bf16(rng: np.random.Generator, shape, std: float) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape) * std, BF16)


def _ulp(v: np.ndarray) -> np.ndarray:
    """bf16's last place at v's magnitude."""
    return 2.0 ** (np.floor(np.log2(np.maximum(np.abs(v), 2.0**-126))) - 7)


def _product_ref(xn: np.ndarray, w: jax.Array, b: jax.Array) -> tuple[np.ndarray, np.ndarray]:
    """(bf16(x @ w in f64) + b in bf16, as the kernel's epilogue rounds it; the exact product)."""
    p = xn.astype(np.float64) @ as_f32(w).astype(np.float64)
    y = jnp.asarray(p.astype(np.float32)).astype(BF16).astype(jnp.float32)
    return as_f32((y + as_f32(b)).astype(BF16)), p


def _within_two_roundings(got: np.ndarray, want: np.ndarray, product: np.ndarray) -> bool:
    """|got - want| within one bf16 rounding of the product and one of the biased sum: an f32 sum in
    another order may round the product to its other neighbour (a tie at most one last place away),
    which the bias add's rounding can carry to two last places of a smaller result."""
    return bool((np.abs(got - want) <= _ulp(product) + _ulp(want)).all())


def test_split_k_rows_with_the_layer_norm_residual_and_tau_dots():
    """Clusters of 2 over an MoE layer's QKV + router-like pair with everything inside: the
    normalised rows and the residual stream's new row are the unsplit kernel's bit for bit (every
    CTA forms them as before); the products are within one bf16 rounding of the unsplit kernel's
    (the f32 sum runs in another order; `_within_two_roundings`) and of an f64 reference on the
    normalised row, and equal to the reference in at least 90% of places; the tau dots
    within f32 rounding of the unsplit kernel's."""
    rng = fresh_rng()
    K, N1, N2 = 512, 192, 64
    x = jnp.asarray(rng.standard_normal((1, K)) * 2, BF16)
    w1, b1 = _bf16(rng, (K, N1), 0.05), _bf16(rng, (N1,), 1.0)
    w2, b2 = _bf16(rng, (K, N2), 0.05), _bf16(rng, (N2,), 1.0)
    wq, wv = _bf16(rng, (g.TAU_ROWS // 2, N1), 0.1), _bf16(rng, (g.TAU_ROWS // 2, N1), 0.1)
    scale, shift = jnp.asarray(rng.uniform(0.5, 1.5, K), BF16), _bf16(rng, (K,), 0.1)
    parts = jnp.asarray(rng.standard_normal((4, K)), jnp.float32)
    dest = np.tile(np.arange(0, 64, 8, dtype=np.int32)[:, None], (1, 8))
    expert = (_bf16(rng, (64, K), 1.0), jnp.asarray(dest), jnp.asarray(rng.dirichlet(np.ones(8), 8).T, jnp.float32),
              jnp.ones((1,), jnp.int32))
    run = functools.partial(g.gemv_rows, stages=3, interpret=True, tau_w=(wq, wv), ln=(scale, shift), ln_eps=1e-5,
                            residual=(parts, _bf16(rng, (K,), 0.5), expert))
    ref = jax.jit(run)(x, w1, b1, w2, b2)
    got = jax.jit(functools.partial(run, k_split=2))(x, w1, b1, w2, b2)
    assert [o.shape for o in got] == [o.shape for o in ref] and len(got) == 5  # rows 1, rows 2, dots, n, x'
    y1, y2, dots, n, xr = (as_f32(o) for o in got)
    r1, r2, rdots, rn, rxr = (as_f32(o) for o in ref)
    np.testing.assert_array_equal(n, rn)
    np.testing.assert_array_equal(xr, rxr)
    assert np.isfinite(y1).all() and np.isfinite(y2).all() and np.abs(y1).max() > 0
    for a, b, w, bias in ((y1, r1, w1, b1), (y2, r2, w2, b2)):
        want, product = _product_ref(n[:1], w, bias)
        assert _within_two_roundings(a[:1], b[:1], product) and _within_two_roundings(a[:1], want, product)
        assert (np.abs(a[:1] - want) > 0).mean() < 0.1  # (mostly the same rows: a bound that is not loose)
        np.testing.assert_array_equal(a[1:], b[1:])  # the padding rows: the bias alone
    np.testing.assert_allclose(dots, rdots, rtol=2e-2, atol=1e-3 * np.abs(rdots).max())


def test_split_k_rows_of_several_rows_without_the_layer_norm():
    """Three rows of x, no LayerNorm, one product with a bias: within the two bf16 roundings of the
    f64 reference (`_within_two_roundings`), equal to it in at least 90% of places; rows past 3 (the
    padding rows x gains) hold the bias alone."""
    rng = fresh_rng()
    K, N = 512, 128
    x, w, b = _bf16(rng, (3, K), 1.0), _bf16(rng, (K, N), 0.05), _bf16(rng, (N,), 1.0)
    (y,) = jax.jit(functools.partial(g.gemv_rows, stages=2, interpret=True, k_split=2))(x, w, b, None, None)
    y = as_f32(y)
    assert y.shape == (8, N)
    want, product = _product_ref(as_f32(x), w, b)
    assert _within_two_roundings(y[:3], want, product) and (np.abs(y[:3] - want) > 0).mean() < 0.1
    np.testing.assert_array_equal(y[3:], np.broadcast_to(as_f32(b), (5, N)))


@pytest.mark.parametrize("k_split", [3, 8, 0])
def test_split_k_refuses_what_it_cannot_split(k_split: int):
    with pytest.raises(ValueError, match="k_split must be 1, 2 or 4"):
        jax.eval_shape(functools.partial(g.gemv_rows, k_split=k_split), _SDS((1, 512), BF16), _SDS((512, 64), BF16),
                       None)
    with pytest.raises(ValueError, match="k_split must be 1, 2 or 4 and divide the 2 K steps"):
        jax.eval_shape(functools.partial(g.gemv_rows, k_split=4), _SDS((1, 128), BF16), _SDS((128, 64), BF16), None)
