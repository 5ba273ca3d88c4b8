"""A decode MoE layer's LayerNorm as one Pallas Triton launch, written the way its kernels read it.

At batch 1 the normalised rows of an MoE layer feed two kernels: the decode GEMM's rows kernel
(QKV + router, `gemv_mgpu.gemv_rows`) reads them as bf16 rows padded to its 8-row tile, and the
MoE's expert GEMMs read them as bf16 (W8A8, the default) or, in the W8A16 mode
(KESTREL_JAX_W8A8_MIN_TOKENS=2), as f16 (`moe_mgpu`: clipped to +-65504). XLA ran that as three
launches per layer: the statistics, then normalise + pad, then normalise + convert + pad (each
consumer recomputing the normalisation from x). `layer_norm_rows_kernel` does the statistics, the
normalisation and both copies in one, over a grid of padded rows.

Numerics are `layers.layer_norm`'s: float32 statistics from one pass (E[x], E[x^2], the variance
clamped at 0), (x - mean) * rsqrt(var + eps) * scale + bias, rounded to x's dtype; the f16 copy is
that rounded row clipped and converted, as `moe_mgpu` forms it. Padding rows are zero in both.
The sums are reduced in Triton's order rather than XLA's, so a row can differ from the jnp path in
the last bit of its statistics.

`residual_layer_norm_rows_kernel` also ends the previous MoE layer in the same launch: each
program forms its row of x' = (x + attn) + sum_j w_j * y_j (the parallel block's residual: the
finished attention projection and the unreduced expert rows, `ExpertRows`), writes x' and
normalises it with the next layer's weights. The residual's roundings are the model's expressions
(`residual_layer_norm_rows_ref`): each add rounded to x's dtype, the expert rows weighted and
summed in f32 in choice order. Opt-in (KESTREL_JAX_RESIDUAL_LN=1): measured no faster on the H100
(`ops.residual_layer_norm_wanted` has the figures).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kestrel_jax.pallas.decode_residual import ExpertRows, combine_rows

F16_MAX = 65504.0
NUM_WARPS = 4


def layer_norm_rows_problem(x: jax.Array, scale: jax.Array, bias: jax.Array, pad_rows: int) -> str | None:
    """Why `layer_norm_rows_kernel` cannot take these shapes (None: it can)."""
    if x.ndim != 2:
        return f"x must be [rows, D], got {x.shape}"
    T, D = x.shape
    if D & (D - 1) or D < 16:
        return f"width {D} must be a power of two (a Triton block)"
    if scale.shape != (D,) or bias.shape != (D,):
        return f"scale {scale.shape} / bias {bias.shape} must be [{D}]"
    if pad_rows < T:
        return f"pad_rows {pad_rows} < rows {T}"
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return f"x must be bf16 or f32, got {x.dtype}"
    return None


def _normalise(xf, m, scale_ref, bias_ref, n_ref, f16_ref, eps: float) -> None:
    """Row m of LN(xf) (f32 [D]) into n_ref, and its f16 copy into f16_ref unless None."""
    f32 = jnp.float32
    D = n_ref.shape[1]
    scale = scale_ref[...].astype(f32)
    shift = bias_ref[...].astype(f32)
    mean = jnp.sum(xf) / D
    var = jnp.maximum(jnp.sum(xf * xf) / D - mean * mean, 0.0)
    n = ((xf - mean) * jax.lax.rsqrt(var + eps) * scale + shift).astype(n_ref.dtype)
    n_ref[m, :] = n
    if f16_ref is not None:
        f16_ref[m, :] = jnp.minimum(jnp.maximum(n.astype(f32), -F16_MAX), F16_MAX).astype(jnp.float16)


def _zero_row(m, n_ref, f16_ref) -> None:
    """Padding row m: zeros (in the f16 copy too unless None)."""
    D = n_ref.shape[1]
    n_ref[m, :] = jnp.zeros((D,), n_ref.dtype)
    if f16_ref is not None:
        f16_ref[m, :] = jnp.zeros((D,), jnp.float16)


def _kernel(x_ref, scale_ref, bias_ref, n_ref, *refs, rows: int, eps: float, f16: bool):
    m = pl.program_id(0)
    f16_ref = refs[0] if f16 else None

    @pl.when(m < rows)
    def _row():
        _normalise(x_ref[m, :].astype(jnp.float32), m, scale_ref, bias_ref, n_ref, f16_ref, eps)

    @pl.when(m >= rows)
    def _pad():
        _zero_row(m, n_ref, f16_ref)


def _residual_kernel(x_ref, a_ref, y_ref, dest_ref, w_ref, nv_ref, scale_ref, bias_ref, xo_ref, n_ref, *refs,
                     rows: int, eps: float):
    f32 = jnp.float32
    m = pl.program_id(0)  # read outside pl.when (the interpreter's rule)
    K = dest_ref.shape[0]
    f16_ref = refs[0] if refs else None

    @pl.when(m < rows)
    def _row():
        dt = xo_ref.dtype
        # every load first (straight-line code: all in flight together), then the arithmetic
        x = x_ref[m, :].astype(f32)
        a = a_ref[m, :].astype(f32)
        picks = [(dest_ref[k, m], w_ref[k, m]) for k in range(K)]
        ys = [y_ref[d, :] for d, _ in picks]
        ok = m < nv_ref[0]  # padding tokens: their rows were never written (may hold NaN)
        t1 = (x + a).astype(dt).astype(f32)
        mc = jnp.zeros_like(x)
        for (_, w), yv in zip(picks, ys, strict=True):
            mc = mc + jnp.where(ok, w * yv.astype(f32), 0.0)
        xn = (t1 + mc.astype(dt).astype(f32)).astype(dt)
        xo_ref[m, :] = xn
        _normalise(xn.astype(f32), m, scale_ref, bias_ref, n_ref, f16_ref, eps)

    @pl.when(m >= rows)
    def _pad():
        _zero_row(m, n_ref, f16_ref)


@functools.partial(jax.jit, static_argnames=("eps", "pad_rows", "f16_copy", "interpret", "num_warps"))
def layer_norm_rows_kernel(x: jax.Array, scale: jax.Array, bias: jax.Array, *, eps: float, pad_rows: int,
                           f16_copy: bool = False, interpret: bool = False,
                           num_warps: int = NUM_WARPS) -> tuple[jax.Array, jax.Array | None]:
    """-> (LN(x) padded with zero rows to [pad_rows, D] in x.dtype, its f16 copy or None)."""
    problem = layer_norm_rows_problem(x, scale, bias, pad_rows)
    if problem is not None:
        raise ValueError(f"layer_norm_rows_kernel: {problem}")
    T, D = x.shape
    shapes = [jax.ShapeDtypeStruct((pad_rows, D), x.dtype)]
    if f16_copy:
        shapes.append(jax.ShapeDtypeStruct((pad_rows, D), jnp.float16))
    out = pl.pallas_call(
        functools.partial(_kernel, rows=T, eps=eps, f16=f16_copy),
        out_shape=tuple(shapes),
        grid=(pad_rows,),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kestrel_layer_norm_rows",
    )(x, scale, bias)
    return out[0], (out[1] if f16_copy else None)


def layer_norm_rows_ref(x: jax.Array, scale: jax.Array, bias: jax.Array, *, eps: float, pad_rows: int,
                        f16_copy: bool = False) -> tuple[jax.Array, jax.Array | None]:
    """The jnp path's expressions (`layers.layer_norm`, then the pad and `moe_mgpu`'s f16 copy)."""
    from kestrel_jax.models.layers import layer_norm

    n = jnp.pad(layer_norm(x, scale, bias, eps), ((0, pad_rows - x.shape[0]), (0, 0)))
    if not f16_copy:
        return n, None
    return n, jnp.clip(n.astype(jnp.float32), -F16_MAX, F16_MAX).astype(jnp.float16)


def residual_layer_norm_rows_problem(x: jax.Array, a: jax.Array, moe: ExpertRows, scale: jax.Array,
                                     bias: jax.Array, pad_rows: int) -> str | None:
    """Why `residual_layer_norm_rows_kernel` cannot take these shapes (None: it can)."""
    problem = layer_norm_rows_problem(x, scale, bias, pad_rows)
    if problem is not None:
        return problem
    T, D = x.shape
    if a.ndim != 2 or a.shape[1] != D or a.shape[0] < T or a.dtype != x.dtype:
        return f"attention output {a.shape} {a.dtype} must be x's rows {x.shape} {x.dtype} (padded or not)"
    if moe.y.ndim != 2 or moe.y.shape[1] != D or moe.dest.shape != moe.weights.shape or moe.dest.ndim != 2 \
            or moe.dest.shape[1] < T:
        return f"expert rows {moe.y.shape} / dest {moe.dest.shape} / weights {moe.weights.shape} do not fit x {x.shape}"
    return None


@functools.partial(jax.jit, static_argnames=("eps", "pad_rows", "f16_copy", "interpret", "num_warps"))
def residual_layer_norm_rows_kernel(x: jax.Array, a: jax.Array, moe: ExpertRows, scale: jax.Array, bias: jax.Array,
                                    *, eps: float, pad_rows: int, f16_copy: bool = False, interpret: bool = False,
                                    num_warps: int = NUM_WARPS) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """-> (x' = (x + a) + the expert rows' weighted sum [T, D], LN(x') padded with zero rows to
    [pad_rows, D] in x.dtype, its f16 copy or None), one program per padded row. `a` may come
    padded past x's T rows (the decode GEMM's row tile): rows >= T are not read."""
    problem = residual_layer_norm_rows_problem(x, a, moe, scale, bias, pad_rows)
    if problem is not None:
        raise ValueError(f"residual_layer_norm_rows_kernel: {problem}")
    T, D = x.shape
    shapes = [jax.ShapeDtypeStruct((T, D), x.dtype), jax.ShapeDtypeStruct((pad_rows, D), x.dtype)]
    if f16_copy:
        shapes.append(jax.ShapeDtypeStruct((pad_rows, D), jnp.float16))
    out = pl.pallas_call(
        functools.partial(_residual_kernel, rows=T, eps=eps),
        out_shape=tuple(shapes),
        grid=(pad_rows,),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kestrel_residual_layer_norm",
    )(x, a, moe.y, moe.dest.astype(jnp.int32), moe.weights.astype(jnp.float32),
      moe.n_valid.astype(jnp.int32).reshape(1), scale, bias)
    return out[0], out[1], (out[2] if f16_copy else None)


def residual_layer_norm_rows_ref(x: jax.Array, a: jax.Array, moe: ExpertRows, scale: jax.Array, bias: jax.Array,
                                 *, eps: float, pad_rows: int, f16_copy: bool = False
                                 ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """The model's unfused expressions: x' = (x + a) + `combine_rows`, then `layer_norm_rows_ref`."""
    x_new = (x + a[: x.shape[0]]) + combine_rows(moe, x.shape[0], x.dtype)
    return (x_new, *layer_norm_rows_ref(x_new, scale, bias, eps=eps, pad_rows=pad_rows, f16_copy=f16_copy))
