"""End of a decode MoE layer in one launch: residual adds, and the next layer's LayerNorm.

A parallel-residual block ends with x' = (x + attn) + moe. At decode on a GPU both branches come
out of kernels unreduced: the output projection as the decode GEMM's split-K partials
(`gemv_mgpu.gemv_partials`, [S, D, Mp] f32 of y^T) and the MoE layer as its expert rows (the down
GEMM's [R, D] output, each token's k rows and softmax weights). XLA then ran four kernels per
layer: the partial sum + bias + residual + expert-weighted sum (one fusion), the next layer's
LayerNorm statistics, and its normalisation + padding to the decode GEMM's 8 rows (H100, seventh
session HLO: 2.3 + 1.3 + 1.5 us of mostly launch and tail, 20 MoE layers per token).

`residual_ln_kernel` (Pallas Triton, one program per padded row) does all of it: x' rows, and
LN(x') with the next layer's weights written as the [Mp, D] rows the next layer's decode GEMM and
MoE kernels read (rows >= T zero). Numerics are the jnp path's: the partials summed in split order
in f32, rounded to the activation dtype, bias added there; the two residual adds rounded after
each; the expert rows weighted and summed in f32 in choice order; LayerNorm in f32 from one pass
(E[x], E[x^2]) as `layers.layer_norm`. `residual_ln_ref` is that math in jnp (the model's unfused
expressions).

Measured (H100, seventh session, MD3 batch-1 decode): correct (hidden states of one decode
forward identical to the unfused path at 1 and 4 rows), but 33 us per call, so batch-1 decode
fell from 609 to 447 tok/s; the model uses it only when `KESTREL_JAX_DECODE_RESIDUAL=1`. Why: one
program per token row reads that row's share of the split partials, strided ([S, D, Mp] with
Mp = 8: every f32 of a row is its own 32-byte sector, 8 splits x 2048 values ~ 0.5 MB for one
row at batch 1) and the k expert rows, on one SM, where XLA's fusion spreads the same reads over
many SMs. The route tables' [k, P] dest/weight arrays also reached the kernel through two slice
kernels. A design that parallelises over D needs the LayerNorm statistics across programs: a
second small launch (x' and partial sums, then normalise) or partials laid out [S, Mp, D].
"""


from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kestrel_jax.models.layers import layer_norm

NUM_WARPS = 8


class ProjParts(NamedTuple):
    """An unreduced decode GEMM product: y = (sum_s parts[s]).T[:rows] (+ bias)."""

    parts: jax.Array  # [S, N, Mp] f32 partials of y^T (columns >= rows are zero)
    bias: jax.Array | None  # [N]
    rows: int  # real rows (static)


class ExpertRows(NamedTuple):
    """An unreduced MoE output: out[t] = sum_j weights[t, j] * y[dest[t, j]] over valid choices."""

    y: jax.Array  # [R, D] expert output rows
    dest: jax.Array  # [T, k] int32
    weights: jax.Array  # [T, k] f32
    valid: jax.Array  # [T, k] bool


def finish_proj(p: ProjParts, dtype: jnp.dtype) -> jax.Array:
    """The product as the jnp path forms it: f32 split sum in order, rounded, bias added in dtype."""
    y = functools.reduce(jnp.add, [p.parts[i] for i in range(p.parts.shape[0])]).T[: p.rows].astype(dtype)
    return y if p.bias is None else y + p.bias.astype(dtype)


def combine_rows(r: ExpertRows, dtype: jnp.dtype) -> jax.Array:
    """out[t] = sum_j w[t, j] * y[dest[t, j]] in f32 (NaN-safe `where` for padding), in dtype."""
    w = r.weights.astype(jnp.float32)[..., None]
    yk = jnp.where(r.valid[..., None], w * r.y[r.dest].astype(jnp.float32), 0.0)
    return jnp.sum(yk, axis=1).astype(dtype)


def residual_ln_ref(x: jax.Array, proj: ProjParts, moe: ExpertRows, ln: tuple[jax.Array, jax.Array] | None, *,
                    eps: float, pad_rows: int) -> tuple[jax.Array, jax.Array | None]:
    """-> (x' = (x + proj) + moe [T, D], LN(x') padded to [pad_rows, D] with zero rows, or None)."""
    x_new = (x + finish_proj(proj, x.dtype)) + combine_rows(moe, x.dtype)
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
    if moe.y.shape[1] != D or moe.dest.shape != moe.weights.shape or moe.dest.shape[0] != T:
        return f"expert rows {moe.y.shape} / dest {moe.dest.shape} do not fit x {x.shape}"
    if pad_rows < T:
        return f"pad_rows {pad_rows} < rows {T}"
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return f"x must be bf16 or f32, got {x.dtype}"
    return None


def _kernel(x_ref, parts_ref, y_ref, dest_ref, w_ref, valid_ref, *more, rows: int, has_bias: bool, has_ln: bool,
            eps: float):
    rest = list(more)
    bias_ref = rest.pop(0) if has_bias else None
    if has_ln:
        scale_ref, shift_ref, xo_ref, n_ref = rest
    else:
        (xo_ref,) = rest
    f32 = jnp.float32
    dt = xo_ref.dtype
    m = pl.program_id(0)
    S, D, _ = parts_ref.shape
    K = dest_ref.shape[1]

    @pl.when(m < rows)
    def _row():
        # every load first (straight-line code: all in flight together), then the arithmetic
        x = x_ref[m, :].astype(f32)
        parts = [parts_ref[s, :, m] for s in range(S)]
        picks = [(dest_ref[m, j], w_ref[m, j], valid_ref[m, j]) for j in range(K)]
        ys = [y_ref[d, :] for d, _, _ in picks]
        acc = parts[0]
        for p in parts[1:]:
            acc = acc + p
        a = acc.astype(dt).astype(f32)
        if bias_ref is not None:
            a = (a + bias_ref[...].astype(f32)).astype(dt).astype(f32)
        t1 = (x + a).astype(dt).astype(f32)
        mc = jnp.zeros((D,), f32)
        for (_, w, ok), yv in zip(picks, ys, strict=True):
            mc = mc + jnp.where(ok != 0, w * yv.astype(f32), 0.0)
        xn = (t1 + mc.astype(dt).astype(f32)).astype(dt)
        xo_ref[m, :] = xn
        if has_ln:
            xf = xn.astype(f32)
            mean = jnp.sum(xf) / D
            var = jnp.maximum(jnp.sum(xf * xf) / D - mean * mean, 0.0)
            yn = (xf - mean) * jax.lax.rsqrt(var + eps)
            yn = yn * scale_ref[...].astype(f32) + shift_ref[...].astype(f32)
            n_ref[m, :] = yn.astype(n_ref.dtype)

    if has_ln:
        @pl.when(m >= rows)
        def _pad():
            n_ref[m, :] = jnp.zeros((D,), n_ref.dtype)


def residual_ln_kernel(x: jax.Array, proj: ProjParts, moe: ExpertRows, ln: tuple[jax.Array, jax.Array] | None, *,
                       eps: float, pad_rows: int, interpret: bool = False,
                       num_warps: int = NUM_WARPS) -> tuple[jax.Array, jax.Array | None]:
    """Kernel twin of `residual_ln_ref` (same arguments and results). Not jitted itself: `proj.rows`
    is a static Python int inside the caller's trace."""
    problem = residual_ln_problem(x, proj, moe, pad_rows)
    if problem is not None:
        raise ValueError(f"residual_ln_kernel: {problem}")
    T, D = x.shape
    ins = [x, proj.parts, moe.y, moe.dest.astype(jnp.int32), moe.weights.astype(jnp.float32),
           moe.valid.astype(jnp.int32)]
    if proj.bias is not None:
        ins.append(proj.bias)
    if ln is not None:
        ins += [ln[0], ln[1]]
    out_shape = [jax.ShapeDtypeStruct((T, D), x.dtype)]
    if ln is not None:
        out_shape.append(jax.ShapeDtypeStruct((pad_rows, D), x.dtype))
    outs = pl.pallas_call(
        functools.partial(_kernel, rows=T, has_bias=proj.bias is not None, has_ln=ln is not None, eps=eps),
        out_shape=tuple(out_shape),
        grid=(pad_rows if ln is not None else T,),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kestrel_decode_residual",
    )(*ins)
    return (outs[0], outs[1]) if ln is not None else (outs[0], None)
