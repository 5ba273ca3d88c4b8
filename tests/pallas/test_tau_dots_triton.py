"""MD3 tau's dots with the GELU in the same launch (`tau_dots_triton`), interpreted on the CPU
against the jnp path's expressions on fresh random rows: per-split partials that sum to the dots
of GELU(u) rounded to u's dtype, within f32 summation-order error; poisoned outputs fully
overwritten; shapes it refuses refused; cross-lowered for an H100 at MD3's prefill shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType
from kernel_helpers import fresh_rng

from kestrel_jax.pallas import tau_dots_triton as td

BF16 = jnp.bfloat16


def _inputs(rng: np.random.Generator, t: int, n: int, h: int, dtype=BF16):
    u = jnp.asarray(rng.standard_normal((t, n)) * rng.choice([0.3, 1.0, 4.0], (t, 1)), dtype)
    wq = jnp.asarray(rng.standard_normal((h, n)) / np.sqrt(n), BF16)
    wv = jnp.asarray(rng.standard_normal((h, n)) / np.sqrt(n), BF16)
    return u, wq, wv


@pytest.mark.parametrize("dtype", [BF16, jnp.float32])
@pytest.mark.parametrize("t,n", [(64, 512), (128, 2048)])
def test_partials_sum_to_the_reference_dots(t: int, n: int, dtype) -> None:
    rng = fresh_rng()
    u, wq, wv = _inputs(rng, t, n, 16, dtype)
    pq, pv = td.tau_dots(u, wq, wv, interpret=True)
    assert pq.shape == pv.shape == (n // td.SPLIT, t, 16) and pq.dtype == jnp.float32
    rq, rv = td.tau_dots_ref(u, wq, wv)
    for got_j, want_j in ((pq.sum(0), rq), (pv.sum(0), rv)):
        got, want = np.asarray(got_j), np.asarray(want_j)
        assert np.isfinite(got).all()
        # f32 sums of n bf16 products in another order: a few ulps of the largest term's scale
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # a different GELU input gives different dots (the kernel really reads u and both weights)
    pq2, pv2 = td.tau_dots(u.at[0].multiply(2.0), wq, wv, interpret=True)
    assert not np.allclose(np.asarray(pq2.sum(0))[0], np.asarray(rq)[0])
    assert np.array_equal(np.asarray(pv2.sum(0))[1:], np.asarray(pv.sum(0))[1:])


def test_refuses_what_it_cannot_tile() -> None:
    assert td.tau_dots_supported(1536, 6144, 32, BF16)
    assert not td.tau_dots_supported(1537, 6144, 32, BF16)  # a mixed step with one decode row
    assert not td.tau_dots_supported(1536, 6000, 32, BF16)
    assert not td.tau_dots_supported(1536, 6144, 24, BF16)
    assert not td.tau_dots_supported(1536, 6144, 32, jnp.float16)
    assert td.tau_dots_supported(32, 6144, 32, BF16, block_rows=32)  # a sweep's own tiling
    assert not td.tau_dots_supported(1536, 6144, 32, BF16, split=96)  # not whole chunks
    z = jnp.zeros((65, 1024), BF16)
    with pytest.raises(ValueError, match="unsupported"):
        td.tau_dots(z, jnp.zeros((16, 1024), BF16), jnp.zeros((16, 1024), BF16), interpret=True)
    with pytest.raises(ValueError, match="weights"):
        td.tau_dots(z[:64], jnp.zeros((16, 1024), BF16), jnp.zeros((16, 2048), BF16), interpret=True)


def test_lowers_at_md3_prefill_shapes() -> None:
    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    for t in (128, 1536, 1600, 2048):
        args = (jax.ShapeDtypeStruct((t, 6144), BF16), jax.ShapeDtypeStruct((32, 6144), BF16),
                jax.ShapeDtypeStruct((32, 6144), BF16))
        with jax.sharding.use_abstract_mesh(mesh):
            text = jax.jit(td.tau_dots).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text


def test_tau_factors_with_the_kernel_match_xla_path() -> None:
    """`qkv_epilogue.tau_factors` with the kernel's dots (interpreted) against XLA's GELU + product:
    the factors agree to a bf16 step (the dots are rounded to bf16 after sums in another order)."""
    from kestrel_jax.pallas import ops
    from kestrel_jax.pallas import qkv_epilogue as qe

    rng = fresh_rng()
    u, wq, wv = _inputs(rng, 128, 2048, 16)
    tau = qe.TauWeights(wq, wv, jnp.asarray(rng.standard_normal(16), BF16))
    positions = jnp.asarray(rng.integers(0, 2000, 128), jnp.int32)

    def kernel_dots(x, t):
        pq, pv = td.tau_dots(x, t.wq, t.wv, interpret=True)
        return pq.sum(0), pv.sum(0)

    got = qe.tau_factors(u, positions, tau, ops._gelu_poly, kernel_dots)
    want = qe.tau_factors(u, positions, tau, ops._gelu_poly)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2 * 2.0**-8, rtol=0)
    assert np.mean(np.asarray(got[0]) == np.asarray(want[0])) > 0.9  # mostly the same bf16 dot


def test_switch_and_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    from kestrel_jax.pallas import ops
    from kestrel_jax.pallas import qkv_epilogue as qe

    monkeypatch.delenv("KESTREL_JAX_TAU_DOTS_KERNEL", raising=False)
    with ops.use_backend("kernel"):
        assert ops.tau_dots_fn() is None  # opt-in
    monkeypatch.setenv("KESTREL_JAX_TAU_DOTS_KERNEL", "1")
    with ops.use_backend("reference"):
        assert ops.tau_dots_fn() is None
    with ops.use_backend("kernel"):
        fn = ops.tau_dots_fn()
    assert fn is not None
    tau = qe.TauWeights(jnp.zeros((16, 1024), BF16), jnp.zeros((16, 1024), BF16), jnp.zeros((16,), BF16))
    pos = jnp.zeros((64,), jnp.int32)
    traced = str(jax.make_jaxpr(lambda u: qe.tau_factors(u, pos, tau, dots=fn))(jnp.zeros((64, 1024), BF16)))
    assert "kestrel_tau_dots" in traced
    assert fn(jnp.zeros((65, 1024), BF16), tau) is None  # rows it does not tile: XLA's path
    traced = str(jax.make_jaxpr(lambda u: qe.tau_factors(u, pos[:1].repeat(65), tau, dots=fn))(
        jnp.zeros((65, 1024), BF16)))
    assert "kestrel_tau_dots" not in traced and "dot_general" in traced
