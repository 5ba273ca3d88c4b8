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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

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


def _kernel(x_ref, scale_ref, bias_ref, n_ref, *f16_ref, rows: int, eps: float):
    f32 = jnp.float32
    m = pl.program_id(0)
    D = n_ref.shape[1]

    @pl.when(m < rows)
    def _row():
        xf = x_ref[m, :].astype(f32)
        scale = scale_ref[...].astype(f32)
        shift = bias_ref[...].astype(f32)
        mean = jnp.sum(xf) / D
        var = jnp.maximum(jnp.sum(xf * xf) / D - mean * mean, 0.0)
        n = ((xf - mean) * jax.lax.rsqrt(var + eps) * scale + shift).astype(n_ref.dtype)
        n_ref[m, :] = n
        if f16_ref:
            f16_ref[0][m, :] = jnp.minimum(jnp.maximum(n.astype(f32), -F16_MAX), F16_MAX).astype(jnp.float16)

    @pl.when(m >= rows)
    def _pad():
        n_ref[m, :] = jnp.zeros((D,), n_ref.dtype)
        if f16_ref:
            f16_ref[0][m, :] = jnp.zeros((D,), jnp.float16)


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
        functools.partial(_kernel, rows=T, eps=eps),
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
