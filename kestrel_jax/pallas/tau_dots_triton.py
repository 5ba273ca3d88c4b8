"""MD3 tau's two dot products at prefill sizes, with the GELU in the same launch (Pallas Triton).

Per layer tau needs, for every row of the fused QKV product u [T, N] (N = 6,144 in MD3),
g = GELU_erf(u) and the dots g . wq[h], g . wv[h] for the H = 32 heads (MOONDREAM.md §3.3.2).
XLA runs that as an elementwise GELU pass that writes g (bf16, the size of u) and a split-K GEMM
that reads it back, plus a run-time concatenation of wq and wv for its merged product: on the
H100 at a two-image prefill (1,536 rows) 15.2 + 8.0 + 2.6 us per layer (twenty-fourth session's
probe), 24 layers per step. Here one launch reads u once: grid (row blocks, column splits),
each program forms GELU over its [BM, column split] tile in float32 (the kernels' polynomial erf,
`moe.gelu_erf_poly`), rounds it to u's dtype as the jnp path does, and multiplies it with both
heads' weight tiles on the tensor cores (f32 accumulation). Outputs are per-split partial sums,
f32 [splits, T, H] for q and for v, which the caller sums (one small XLA fusion with the tanh and
the position term that follow).

Measured slower than XLA's path on the H100 (twenty-fourth session, BENCHMARKS.md): 122.7 us per
layer at 1,536 rows with the chunks unrolled, 156-356 us host-timed per call with the loop across
the tilings swept, against ~26 us of XLA kernels; so `ops.tau_dots_fn` keeps it behind an opt-in
switch.

Shapes: T a multiple of the row block (every prefill bucket is; a mixed step with one decode row
is not: `tau_dots_supported` says so and the caller keeps XLA's path), N a multiple of the column
split, H a power of two >= 16 (tensor-core tile).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kestrel_jax.pallas.moe import gelu_erf_poly

BLOCK_ROWS = 64  # rows of u per program
SPLIT = 512  # columns of u per program (MD3: 12 splits; 1,536 rows -> 288 programs)
CHUNK = 64  # columns per tensor-core step inside a program
NUM_WARPS = 4
NUM_STAGES = 3


def tau_dots_supported(rows: int, cols: int, heads: int, dtype: jnp.dtype, *, split: int = SPLIT,
                       block_rows: int = BLOCK_ROWS) -> bool:
    """Whether `tau_dots` takes u [rows, cols] with `heads` tau heads at this tiling."""
    return (rows > 0 and block_rows > 0 and rows % block_rows == 0 and split > 0 and split % CHUNK == 0
            and cols > 0 and cols % split == 0 and heads >= 16 and heads & (heads - 1) == 0
            and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)))


_NT = (((1,), (1,)), ((), ()))  # g [BM, C] . w [H, C] over C


def _kernel(u_ref, wq_ref, wv_ref, oq_ref, ov_ref, *, low: bool):
    f32 = jnp.float32
    prec = None if low else lax.Precision.HIGHEST  # f32 u: no TF32 rounding of the operands
    bm, split = u_ref.shape
    h = wq_ref.shape[0]

    def chunk(i, acc):  # a loop, not unrolled: Triton pipelines its loads (num_stages)
        acc_q, acc_v = acc
        cols = pl.ds(pl.multiple_of(i * CHUNK, CHUNK), CHUNK)
        g = gelu_erf_poly(u_ref[:, cols].astype(f32))
        g = g.astype(u_ref.dtype)  # the jnp path holds GELU's output in u's dtype
        wq = wq_ref[:, cols].astype(u_ref.dtype)
        wv = wv_ref[:, cols].astype(u_ref.dtype)
        acc_q += lax.dot_general(g, wq, _NT, precision=prec, preferred_element_type=f32)
        acc_v += lax.dot_general(g, wv, _NT, precision=prec, preferred_element_type=f32)
        return acc_q, acc_v

    zeros = jnp.zeros((bm, h), f32)
    acc_q, acc_v = lax.fori_loop(0, split // CHUNK, chunk, (zeros, zeros))
    oq_ref[...] = acc_q
    ov_ref[...] = acc_v


@functools.partial(jax.jit, static_argnames=("interpret", "split", "block_rows", "num_warps", "num_stages"))
def tau_dots(u: jax.Array, wq: jax.Array, wv: jax.Array, *, interpret: bool = False, split: int = SPLIT,
             block_rows: int = BLOCK_ROWS, num_warps: int = NUM_WARPS,
             num_stages: int = NUM_STAGES) -> tuple[jax.Array, jax.Array]:
    """u [T, N] (bf16 / f32), wq and wv [H, N] -> per-split partials (f32 [N / split, T, H]) of
    GELU(u) . wq[h] and GELU(u) . wv[h], GELU's output rounded to u's dtype. The tiling arguments
    are for GPU sweeps."""
    t, n = u.shape
    h = wq.shape[0]
    if wq.shape != (h, n) or wv.shape != (h, n):
        raise ValueError(f"tau_dots: weights {wq.shape} / {wv.shape} must be [heads, {n}]")
    if not tau_dots_supported(t, n, h, u.dtype, split=split, block_rows=block_rows):
        raise ValueError(f"tau_dots: unsupported u {u.shape} {u.dtype} with {h} heads")
    splits = n // split
    out = jax.ShapeDtypeStruct((splits, t, h), jnp.float32)
    return pl.pallas_call(
        functools.partial(_kernel, low=jnp.dtype(u.dtype) == jnp.dtype(jnp.bfloat16)),
        out_shape=(out, out),
        grid=(t // block_rows, splits),
        in_specs=[
            pl.BlockSpec((block_rows, split), lambda i, s: (i, s)),
            pl.BlockSpec((h, split), lambda i, s: (0, s)),
            pl.BlockSpec((h, split), lambda i, s: (0, s)),
        ],
        out_specs=[
            pl.BlockSpec((None, block_rows, h), lambda i, s: (s, i, 0)),
            pl.BlockSpec((None, block_rows, h), lambda i, s: (s, i, 0)),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kestrel_tau_dots",
    )(u, wq, wv)


def tau_dots_ref(u: jax.Array, wq: jax.Array, wv: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The jnp path's dots (`qkv_epilogue.tau_factors` with the polynomial GELU), f32 [T, H] each,
    before their rounding to u's dtype."""
    g = gelu_erf_poly(u.astype(jnp.float32)).astype(u.dtype)
    dq = jnp.dot(g, wq.astype(u.dtype).T, preferred_element_type=jnp.float32)
    dv = jnp.dot(g, wv.astype(u.dtype).T, preferred_element_type=jnp.float32)
    return dq, dv
