"""Per-row FP8 quantisation of the MoE activations in one pass (Pallas Triton).

The W8A8 down GEMM reads the up GEMM's GLU output quantised per row (`moe.quantize_rows`: scale =
absmax / 448, values clamped to +-448, e4m3). XLA runs that as two or three kernels: the row
maxima (a reduction), then a second pass that reads every row again to divide, clamp and convert
(and, in the sorted prefill regime, first gathers the compact rows). H100, eleventh session: at
decode (the dense regime's 4,096 block rows of 1,024) 11.3 us per MoE layer in three kernels; in a
2 x 740-token prefill step 32.9 us per layer (row max 11.2 + gather / divide / convert 21.7 us).

`quantize_rows_kernel` reads each row once: a program takes `rows_per_program` rows (each through
an optional row index: the gather), holds them in registers, and writes the e4m3 row and its
scale. Its results are `quantize_rows(x if idx is None else x[idx])`'s (values times the
reciprocal of the scale, as there), with one possible difference on the GPU: Triton lowers a
float32 division (here the reciprocal) to the 2-ulp `div.full.f32` where XLA divides exactly, so a
value whose product lies within a few float32 ulps of an e4m3 rounding boundary (about one in 2^19
values) may round to the neighbouring code. Interpreted (CPU), the results are identical. On the
H100 (`tools/check_quantize_kernel.py`, thirteenth session, with the quotient then written as a
division) no such difference occurred: 136 million codes at the MoE layer's shapes, all equal to
XLA's, scales identical.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kestrel_jax.pallas.moe import FP8_MAX

NUM_WARPS = 4
ROWS_PER_PROGRAM = 4


def quantize_rows_problem(x: jax.Array, idx: jax.Array | None, rows_per_program: int = ROWS_PER_PROGRAM) -> str | None:
    """Why `quantize_rows_kernel` cannot take these arguments (None: it can)."""
    if x.ndim != 2:
        return f"x must be [rows, width], got {x.shape}"
    R, K = x.shape
    if K < 16 or K & (K - 1):
        return f"width {K} must be a power of two >= 16 (one Triton block per row)"
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return f"x must be bf16 or f32, got {x.dtype}"
    if idx is not None and (idx.ndim != 1 or not jnp.issubdtype(idx.dtype, jnp.integer)):
        return f"idx must be a 1-d integer array, got {idx.shape} {idx.dtype}"
    c = R if idx is None else idx.shape[0]
    if c == 0 or rows_per_program < 1 or c % rows_per_program:
        return f"{c} output rows must be a positive multiple of rows_per_program {rows_per_program}"
    return None


def _kernel(*refs, rows_per_program: int, gather: bool, num_src: int):
    idx_ref, x_ref, q_ref, s_ref = refs if gather else (None, *refs)
    f32 = jnp.float32
    p = pl.program_id(0)
    outs = [p * rows_per_program + r for r in range(rows_per_program)]
    # the source rows (clamped: an index past the array reads its last row, as XLA's gather
    # clamps), then every load in flight together, then the arithmetic
    srcs = [jnp.clip(idx_ref[o], 0, num_src - 1) if idx_ref is not None else o for o in outs]
    vals = [x_ref[s, :].astype(f32) for s in srcs]
    for o, v in zip(outs, vals, strict=True):
        amax = jnp.max(jnp.abs(v))
        scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
        inv = 1.0 / scale  # times the reciprocal, as `quantize_rows`
        q_ref[o, :] = jnp.clip(v * inv, -FP8_MAX, FP8_MAX).astype(q_ref.dtype)
        s_ref[o] = scale


def quantize_rows_kernel(x: jax.Array, idx: jax.Array | None = None, *, rows_per_program: int = ROWS_PER_PROGRAM,
                         num_warps: int = NUM_WARPS, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """-> (e4m3 [C, K], f32 scale [C]) of the rows x[idx] (C = len(idx)), or of x itself (C = R)."""
    problem = quantize_rows_problem(x, idx, rows_per_program)
    if problem is not None:
        raise ValueError(f"quantize_rows_kernel: {problem}")
    R, K = x.shape
    C = R if idx is None else idx.shape[0]
    args = (x,) if idx is None else (idx.astype(jnp.int32), x)
    return pl.pallas_call(
        functools.partial(_kernel, rows_per_program=rows_per_program, gather=idx is not None, num_src=R),
        out_shape=(jax.ShapeDtypeStruct((C, K), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((C,), jnp.float32)),
        grid=(C // rows_per_program,),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kestrel_quantize_rows",
    )(*args)
