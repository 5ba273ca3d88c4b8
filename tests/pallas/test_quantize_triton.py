"""The one-pass per-row FP8 quantisation kernel (Pallas Triton), interpreted on the CPU against
`moe.quantize_rows` of the (gathered) rows: identical codes and scales (interpreted, the division
is XLA's), poisoned output buffers fully overwritten, zero rows scaled 1, values past the e4m3
range clamped (no NaN codes); cross-lowered for an H100 at the MoE layer's shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType
from kernel_helpers import fresh_rng

from kestrel_jax.pallas import quantize_triton as qt
from kestrel_jax.pallas.moe import quantize_rows

BF16 = jnp.bfloat16
_SDS = jax.ShapeDtypeStruct


def _rows(rng: np.random.Generator, R: int, K: int, dtype=BF16) -> jax.Array:
    x = rng.standard_normal((R, K)) * rng.choice([1e-3, 1.0, 40.0], (R, 1))  # rows of different ranges
    x[0] = 0.0  # an all-zero row: scale 1, codes 0
    if R > 2:
        x[1, ::7] = 3e4  # far past the largest e4m3 relative to the rest of its row
    return jnp.asarray(x, dtype)


def _same(got: tuple[jax.Array, jax.Array], want: tuple[jax.Array, jax.Array]) -> None:
    gq, gs = (np.asarray(a) for a in got)
    wq, ws = (np.asarray(a) for a in want)
    assert gq.dtype == wq.dtype == np.dtype(jnp.float8_e4m3fn) and gq.shape == wq.shape
    assert not np.isnan(gq.astype(np.float32)).any()
    np.testing.assert_array_equal(gq.view(np.uint8), wq.view(np.uint8))
    np.testing.assert_array_equal(gs, ws)


@pytest.mark.parametrize("R,K,rpp,dtype", [(16, 256, 4, BF16), (24, 1024, 8, BF16), (8, 64, 1, jnp.float32)])
def test_rows_match_quantize_rows(R, K, rpp, dtype):
    x = _rows(fresh_rng(), R, K, dtype)
    got = qt.quantize_rows_kernel(x, rows_per_program=rpp, interpret=True)
    _same(got, quantize_rows(x))
    assert float(np.asarray(got[1])[0]) == 1.0  # the zero row


@pytest.mark.parametrize("R,C,K,rpp", [(32, 48, 128, 4), (64, 8, 512, 8), (40, 12, 256, 2)])
def test_gathered_rows_match_quantize_rows_of_the_gather(R, C, K, rpp):
    rng = fresh_rng()
    x = _rows(rng, R, K)
    idx = jnp.asarray(rng.integers(0, R, C), jnp.int32)  # scrambled, with repeats
    _same(qt.quantize_rows_kernel(x, idx, rows_per_program=rpp, interpret=True), quantize_rows(x[idx]))


def test_every_output_row_is_written():
    """Interpreted Pallas starts every float output as NaN (e4m3fn has a NaN code): a row or scale
    the programs missed would show. Rows taken in reverse through the index."""
    rng = fresh_rng()
    x = _rows(rng, 64, 128)
    q, s = qt.quantize_rows_kernel(x, jnp.arange(64, dtype=jnp.int32)[::-1], interpret=True)
    assert np.isfinite(np.asarray(q).astype(np.float32)).all() and np.isfinite(np.asarray(s)).all()
    _same((q, s), quantize_rows(x[::-1]))


def test_refuses_what_it_cannot_do():
    x = jnp.zeros((8, 96), BF16)
    assert "power of two" in (qt.quantize_rows_problem(x, None) or "")
    assert "multiple" in (qt.quantize_rows_problem(jnp.zeros((6, 128), BF16), None) or "")
    assert "integer" in (qt.quantize_rows_problem(jnp.zeros((8, 128), BF16), jnp.zeros((4,), jnp.float32)) or "")
    assert "bf16 or f32" in (qt.quantize_rows_problem(jnp.zeros((8, 128), jnp.float16), None) or "")
    assert qt.quantize_rows_problem(jnp.zeros((8, 128), BF16), jnp.zeros((4,), jnp.int32)) is None
    with pytest.raises(ValueError, match="power of two"):
        qt.quantize_rows_kernel(x, interpret=True)


def test_lowers_at_moe_shapes():
    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    cases = [((4096, 1024), None), ((12288, 1024), (11840,)), ((64, 2048), None)]
    for shape, idx in cases:
        args = (_SDS(shape, BF16),) if idx is None else (_SDS(shape, BF16), _SDS(idx, jnp.int32))
        with jax.sharding.use_abstract_mesh(mesh):
            text = jax.jit(qt.quantize_rows_kernel).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text
