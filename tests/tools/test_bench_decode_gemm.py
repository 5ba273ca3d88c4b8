"""bench_decode_gemm's FP8-weight variants on the CPU: the per-column quantisation, the XLA forms and
the Mosaic grouped GEMM with one expert (interpreted) against float emulations of the same
arithmetic, so the GPU figures time the products they name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kestrel_jax.pallas import moe
from kestrel_jax.pallas.paged_attention_mgpu import _interpret_params
from tools import bench_decode_gemm as bench

K, N = 256, 192  # N not a multiple of 128: one 64-row tile per unit


@pytest.fixture(scope="module")
def weights() -> tuple[jax.Array, jax.Array, jax.Array]:
    ws = jax.random.normal(jax.random.key(0), (2, K, N), jnp.bfloat16) * 0.02
    w8, s, _ = bench._fp8_weights(ws)
    return ws, w8, s


def test_fp8_weights_round_trip(weights):
    ws, w8, s = weights
    assert w8.dtype == jnp.float8_e4m3fn and w8.shape == ws.shape and s.shape == (2, N)
    back = w8.astype(jnp.float32) * s[:, None, :]
    wf = ws.astype(jnp.float32)
    # e4m3 keeps 3 mantissa bits: within 2^-4 relative of each normal value, and each column's
    # largest magnitude maps to 448 (exact)
    np.testing.assert_array_less(np.abs(back - wf), np.abs(wf) * 2.0**-4 + s[:, None, :] * 2.0**-9)
    np.testing.assert_allclose(np.abs(w8.astype(jnp.float32)).max(axis=1), 448.0)


@pytest.mark.parametrize("m", [1, 13])  # one block of 8 rows, two with padding
def test_fp8_products(weights, m: int):
    """Each variant against the float emulation of its own arithmetic (within bf16 rounding of the
    output), and against the bf16 product within the FP8 error the bench prints (~2-4e-2)."""
    ws, w8, s = weights
    x = jax.random.normal(jax.random.key(m), (m, K), jnp.bfloat16)
    w_deq = w8[0].astype(jnp.float32) * s[0]
    exact = x.astype(jnp.float32) @ ws[0].astype(jnp.float32)
    xq, xs = moe.quantize_rows(x)
    a8 = (xq.astype(jnp.float32) * xs[:, None]) @ w_deq  # rows rounded per row through e4m3
    a16 = x.astype(jnp.float32) @ w_deq
    mosaic = bench._mgpu(x, jnp.swapaxes(w8[0], 0, 1), s[0], True, interpret=_interpret_params(True, False))
    mosaic16 = bench._mgpu(x, jnp.swapaxes(w8[0], 0, 1), s[0], False, interpret=_interpret_params(True, False))
    assert mosaic.shape == (-(-m // 8) * 8, N)
    got = {"xla_w8a16": (bench._w8a16(x, w8[0], s[0]), a16), "xla_w8a8": (bench._w8a8(x, w8[0], s[0]), a8),
           "mgpu_w8a8": (mosaic[:m], a8), "mgpu_w8a16": (mosaic16[:m], a16)}
    top = float(jnp.abs(exact).max())
    for name, (y, emulated) in got.items():
        y = y.astype(jnp.float32)
        assert y.shape == (m, N), name
        assert float(jnp.abs(y - emulated).max()) <= 2.0**-7 * float(jnp.abs(emulated).max()), name
        assert 1e-3 < float(jnp.abs(y - exact).max()) / top < 6e-2, name  # FP8's error, not none
    if mosaic.shape[0] > m:  # padded rows of the Mosaic output stay zero
        assert not np.asarray(mosaic[m:]).any()
