"""End of a decode MoE layer in one launch: residual adds, and the next layer's LayerNorm.

A parallel-residual block ends with x' = (x + attn) + moe. At decode on a GPU both branches come
out of kernels unreduced: the output projection as the decode GEMM's split-K partials
(`gemv_mgpu.gemv_partials`, [S, D, Mp] f32 of y^T) and the MoE layer as its expert rows (the down
GEMM's [R, D] output, each token's k rows and softmax weights). XLA then ran four kernels per
layer: the partial sum + bias + residual + expert-weighted sum (one fusion), the next layer's
LayerNorm statistics, and its normalisation + padding to the decode GEMM's 8 rows (H100, seventh
session HLO: 2.3 + 1.3 + 1.5 us of mostly launch and tail, 20 MoE layers per token).

`residual_ln_kernel` (Pallas Triton) does it in two launches: x' over a (rows, D / BLOCK_D) grid
(each program sums its columns' split partials, adds the bias, the residual and the expert rows of
its token, and writes its block's sum and sum of squares), then LN(x') with the next layer's
weights over the padded rows, written as the [Mp, D] rows the next layer's decode GEMM and MoE
kernels read (rows >= T zero). Numerics are the jnp path's: the partials summed in split order in
f32, rounded to the activation dtype, bias added there; the two residual adds rounded after each;
the expert rows weighted and summed in f32 in choice order; LayerNorm in f32 from one pass (E[x],
E[x^2], here from per-block sums) as `layers.layer_norm`. `residual_ln_ref` is that math in jnp
(the model's unfused expressions).

First build, measured (H100, seventh session, MD3 batch-1 decode): one program per token row did
everything, 33 us per call (batch-1 decode 609 -> 447 tok/s): the row's share of the strided split
partials ([S, D, Mp], Mp = 8: every f32 its own 32-byte sector, ~0.5 MB for one row) and its expert
rows were read by one SM, where XLA's fusion spreads them over many; the routing tables' [k, P]
arrays also reached it through two slice kernels. Hence the column grid, the tables' own layout
(`ExpertRows`), and the statistics handed to a second launch. The model uses it only with
`KESTREL_JAX_DECODE_RESIDUAL=1` until it measures faster than XLA's kernels.
"""


from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kestrel_jax.models.layers import layer_norm

NUM_WARPS = 4
BLOCK_D = 256  # columns per program of the residual launch


class ProjParts(NamedTuple):
    """An unreduced decode GEMM product: y = (sum_s parts[s]).T[:rows] (+ bias)."""

    parts: jax.Array  # [S, N, Mp] f32 partials of y^T (columns >= rows are zero)
    bias: jax.Array | None  # [N]
    rows: int  # real rows (static)


class ExpertRows(NamedTuple):
    """An unreduced MoE output in the routing tables' layout: token t's j-th choice is row
    dest[j, t] of y with weight weights[j, t]; tokens t >= n_valid (padding) contribute nothing.
    out[t] = sum_j weights[j, t] * y[dest[j, t]]."""

    y: jax.Array  # [R, D] expert output rows
    dest: jax.Array  # [k, P] int32, P >= T
    weights: jax.Array  # [k, P] f32
    n_valid: jax.Array  # [1] int32


def finish_proj(p: ProjParts, dtype: jnp.dtype) -> jax.Array:
    """The product as the jnp path forms it: f32 split sum in order, rounded, bias added in dtype."""
    y = functools.reduce(jnp.add, [p.parts[i] for i in range(p.parts.shape[0])]).T[: p.rows].astype(dtype)
    return y if p.bias is None else y + p.bias.astype(dtype)


def combine_rows(r: ExpertRows, tokens: int, dtype: jnp.dtype) -> jax.Array:
    """out[t] = sum_j w[j, t] * y[dest[j, t]] in f32 for t < tokens (NaN-safe `where` for padding
    tokens and rows no kernel wrote), in dtype: one gather-multiply-reduce fusion. (Reading the
    [k, T] tables without transposing them, as k gathers added in order, measured no faster on
    the H100: it saved the two transpose kernels per MoE layer, 2.9 us at 64 rows, and XLA's
    gather fusion grew by as much; twelfth session.)"""
    dest, w = r.dest[:, :tokens].T, r.weights[:, :tokens].T.astype(jnp.float32)[..., None]
    valid = (jnp.arange(tokens) < r.n_valid[0])[:, None, None]
    yk = jnp.where(valid, w * r.y[dest].astype(jnp.float32), 0.0)  # [T, k, D]
    return jnp.sum(yk, axis=1).astype(dtype)


def residual_ln_ref(x: jax.Array, proj: ProjParts, moe: ExpertRows, ln: tuple[jax.Array, jax.Array] | None, *,
                    eps: float, pad_rows: int) -> tuple[jax.Array, jax.Array | None]:
    """-> (x' = (x + proj) + moe [T, D], LN(x') padded to [pad_rows, D] with zero rows, or None)."""
    x_new = (x + finish_proj(proj, x.dtype)) + combine_rows(moe, x.shape[0], x.dtype)
    if ln is None:
        return x_new, None
    n = layer_norm(x_new, ln[0], ln[1], eps)
    return x_new, jnp.pad(n, ((0, pad_rows - x.shape[0]), (0, 0)))


def residual_ln_problem(x: jax.Array, proj: ProjParts, moe: ExpertRows, pad_rows: int) -> str | None:
    """Why `residual_ln_kernel` cannot take these shapes (None: it can)."""
    T, D = x.shape
    S, N, Mp = proj.parts.shape
    if N != D or proj.rows != T or Mp < T:
        return f"projection partials {proj.parts.shape} (rows {proj.rows}) do not fit x {x.shape}"
    if D & (D - 1) or D < 16:
        return f"width {D} must be a power of two (a Triton block)"
    if moe.y.shape[1] != D or moe.dest.shape != moe.weights.shape or moe.dest.shape[1] < T:
        return f"expert rows {moe.y.shape} / dest {moe.dest.shape} do not fit x {x.shape}"
    if D % BLOCK_D or (D // BLOCK_D) & (D // BLOCK_D - 1):
        return f"width {D} must be a power-of-two multiple of {BLOCK_D}"
    if pad_rows < T:
        return f"pad_rows {pad_rows} < rows {T}"
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return f"x must be bf16 or f32, got {x.dtype}"
    return None


def _sum_kernel(x_ref, parts_ref, y_ref, dest_ref, w_ref, nv_ref, *more, has_bias: bool):
    """Program (row m, column block j): x' of that block, and its sum and sum of squares."""
    rest = list(more)
    bias_ref = rest.pop(0) if has_bias else None
    xo_ref, s1_ref, s2_ref = rest
    f32 = jnp.float32
    dt = xo_ref.dtype
    m, j = pl.program_id(0), pl.program_id(1)
    S = parts_ref.shape[0]
    K = dest_ref.shape[0]
    cols = pl.ds(j * BLOCK_D, BLOCK_D)
    # every load first (straight-line code: all in flight together), then the arithmetic
    x = x_ref[m, cols].astype(f32)
    parts = [parts_ref[s, cols, m] for s in range(S)]
    picks = [(dest_ref[k, m], w_ref[k, m]) for k in range(K)]
    ys = [y_ref[d, cols] for d, _ in picks]
    ok = m < nv_ref[0]
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    a = acc.astype(dt).astype(f32)
    if bias_ref is not None:
        a = (a + bias_ref[cols].astype(f32)).astype(dt).astype(f32)
    t1 = (x + a).astype(dt).astype(f32)
    mc = jnp.zeros((BLOCK_D,), f32)
    for (_, w), yv in zip(picks, ys, strict=True):
        mc = mc + jnp.where(ok, w * yv.astype(f32), 0.0)
    xn = (t1 + mc.astype(dt).astype(f32)).astype(dt)
    xo_ref[m, cols] = xn
    xf = xn.astype(f32)
    s1_ref[m, j] = jnp.sum(xf)
    s2_ref[m, j] = jnp.sum(xf * xf)


def _norm_kernel(xo_ref, s1_ref, s2_ref, scale_ref, shift_ref, n_ref, *, rows: int, eps: float):
    """Program (padded row m): LN(x'[m]) from the block sums; zeros for m >= rows."""
    f32 = jnp.float32
    m = pl.program_id(0)
    D = n_ref.shape[1]

    @pl.when(m < rows)
    def _row():
        xf = xo_ref[m, :].astype(f32)
        mean = jnp.sum(s1_ref[m, :]) / D
        var = jnp.maximum(jnp.sum(s2_ref[m, :]) / D - mean * mean, 0.0)
        yn = (xf - mean) * jax.lax.rsqrt(var + eps)
        n_ref[m, :] = (yn * scale_ref[...].astype(f32) + shift_ref[...].astype(f32)).astype(n_ref.dtype)

    @pl.when(m >= rows)
    def _pad():
        n_ref[m, :] = jnp.zeros((D,), n_ref.dtype)


def residual_ln_kernel(x: jax.Array, proj: ProjParts, moe: ExpertRows, ln: tuple[jax.Array, jax.Array] | None, *,
                       eps: float, pad_rows: int, interpret: bool = False,
                       num_warps: int = NUM_WARPS) -> tuple[jax.Array, jax.Array | None]:
    """Kernel twin of `residual_ln_ref` (same arguments and results): two launches, x' with block
    sums over a (rows, D / BLOCK_D) grid, then the LayerNorm over padded rows. Not jitted itself:
    `proj.rows` is a static Python int inside the caller's trace."""
    problem = residual_ln_problem(x, proj, moe, pad_rows)
    if problem is not None:
        raise ValueError(f"residual_ln_kernel: {problem}")
    T, D = x.shape
    nb = D // BLOCK_D
    ins = [x, proj.parts, moe.y, moe.dest.astype(jnp.int32), moe.weights.astype(jnp.float32),
           moe.n_valid.astype(jnp.int32).reshape(1)]
    if proj.bias is not None:
        ins.append(proj.bias)
    params = pltriton.CompilerParams(num_warps=num_warps, num_stages=1)
    x_new, s1, s2 = pl.pallas_call(
        functools.partial(_sum_kernel, has_bias=proj.bias is not None),
        out_shape=(jax.ShapeDtypeStruct((T, D), x.dtype), jax.ShapeDtypeStruct((T, nb), jnp.float32),
                   jax.ShapeDtypeStruct((T, nb), jnp.float32)),
        grid=(T, nb),
        compiler_params=params,
        interpret=interpret,
        name="kestrel_decode_residual",
    )(*ins)
    if ln is None:
        return x_new, None
    n = pl.pallas_call(
        functools.partial(_norm_kernel, rows=T, eps=eps),
        out_shape=jax.ShapeDtypeStruct((pad_rows, D), x.dtype),
        grid=(pad_rows,),
        compiler_params=params,
        interpret=interpret,
        name="kestrel_decode_layernorm",
    )(x_new, s1, s2, ln[0], ln[1])
    return x_new, n
