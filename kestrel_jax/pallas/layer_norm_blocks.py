"""A residual add and the next LayerNorm over many rows, in one Pallas Triton launch.

Prefill-sized steps (the vision encoder's [crops * 729, 1152] activations, the text model's
prefill and mixed steps at [tokens, 2048]) end each block with a residual add and start the next
with a LayerNorm. XLA runs that as two launches: a reduction fusion (the adds and the statistics,
writing the new residual) and an elementwise fusion (the normalisation, re-reading it).
`residual_layer_norm_blocks_kernel` does both in one pass over blocks of rows: each program loads
its rows of x and of the addends once, writes x' and LN(x').

Numerics are the model's expressions (`residual_layer_norm_blocks_ref`): each add is rounded to
x's dtype in order ((x + a) + m for the text model's parallel block), then `layers.layer_norm`:
float32 statistics from one pass (E[x], E[x^2], the variance clamped at 0), (x - mean) *
rsqrt(var + eps) * scale + bias, rounded to x's dtype. The sums are reduced in Triton's order
rather than XLA's, so a row can differ from the jnp path in the last bit of its statistics.

Widths that are not a power of two (the vision encoder's 1152) are loaded as the next power of two
with the lanes past the width masked: they are neither read nor written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kestrel_jax.models.layers import layer_norm

BLOCK_ROWS = 2
NUM_WARPS = 4
MAX_ADDS = 2


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def default_block_rows(width: int) -> int:
    """Rows per program: 2 for power-of-two widths, 1 where lanes past the width are masked.
    Measured on the H200 (session 35, `tools/bench_layer_norm_blocks.py`, 4 warps): [1600, 2048]
    with two addends 9.20 us at 2 rows (9.87 / 9.35 / 9.90 at 1 / 4 / 8); [2916, 1152] with one
    addend 9.10 us at 1 row (9.54 / 10.14 / 12.83 at 2 / 4 / 8) against XLA's 11.37."""
    return BLOCK_ROWS if width == _pow2_at_least(width) else 1


def residual_layer_norm_blocks_problem(x: jax.Array, adds: tuple[jax.Array, ...], scale: jax.Array,
                                       bias: jax.Array, block_rows: int = 1) -> str | None:
    """Why `residual_layer_norm_blocks_kernel` cannot take these shapes (None: it can)."""
    if x.ndim != 2:
        return f"x must be [rows, D], got {x.shape}"
    T, D = x.shape
    if T < 1 or D < 16:
        return f"x {x.shape} needs at least one row and 16 columns"
    if _pow2_at_least(D) * block_rows > 16384:
        return f"a block of {block_rows} rows x {_pow2_at_least(D)} lanes is too large for one program"
    if block_rows < 1 or block_rows & (block_rows - 1):
        return f"block_rows {block_rows} must be a power of two"
    if len(adds) > MAX_ADDS:
        return f"at most {MAX_ADDS} addends, got {len(adds)}"
    for a in adds:
        if a.shape != x.shape or a.dtype != x.dtype:
            return f"addend {a.shape} {a.dtype} must match x {x.shape} {x.dtype}"
    if scale.shape != (D,) or bias.shape != (D,):
        return f"scale {scale.shape} / bias {bias.shape} must be [{D}]"
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return f"x must be bf16 or f32, got {x.dtype}"
    return None


def _kernel(*refs, n_adds: int, rows: int, width: int, block_rows: int, lanes: int, eps: float):
    f32 = jnp.float32
    x_ref = refs[0]
    add_refs = refs[1:1 + n_adds]
    scale_ref, bias_ref = refs[1 + n_adds:3 + n_adds]
    xo_ref = refs[3 + n_adds] if n_adds else None
    n_ref = refs[-1]
    b = pl.program_id(0)
    r = b * block_rows + jnp.arange(block_rows, dtype=jnp.int32)
    c = jnp.arange(lanes, dtype=jnp.int32)
    mask = (r < rows)[:, None] & (c < width)[None, :]
    col_mask = c < width
    # a runtime zero: the block may run past the array's last row and column (masked), which a
    # literal start would have the lowering refuse as out of bounds
    zero = jnp.where(b < 0, 1, 0).astype(jnp.int32)

    def view(ref):
        return ref.at[pl.ds(b * block_rows, block_rows), pl.ds(zero, lanes)]

    # every load first (straight-line code: all in flight together), then the arithmetic
    xv = plgpu.load(view(x_ref), mask=mask, other=0.0)
    avs = [plgpu.load(view(a_ref), mask=mask, other=0.0) for a_ref in add_refs]
    scale = plgpu.load(scale_ref.at[pl.ds(zero, lanes)], mask=col_mask, other=0.0).astype(f32)
    shift = plgpu.load(bias_ref.at[pl.ds(zero, lanes)], mask=col_mask, other=0.0).astype(f32)
    dt = xv.dtype
    for av in avs:
        xv = (xv.astype(f32) + av.astype(f32)).astype(dt)
    if xo_ref is not None:
        plgpu.store(view(xo_ref), xv, mask=mask)
    xf = xv.astype(f32)  # masked lanes are 0: they add nothing to either sum
    mean = jnp.sum(xf, axis=1, keepdims=True) / width
    var = jnp.maximum(jnp.sum(xf * xf, axis=1, keepdims=True) / width - mean * mean, 0.0)
    n = ((xf - mean) * jax.lax.rsqrt(var + eps) * scale[None, :] + shift[None, :]).astype(n_ref.dtype)
    plgpu.store(view(n_ref), n, mask=mask)


@functools.partial(jax.jit, static_argnames=("eps", "block_rows", "num_warps", "interpret"))
def residual_layer_norm_blocks_kernel(x: jax.Array, adds: tuple[jax.Array, ...], scale: jax.Array, bias: jax.Array,
                                      *, eps: float, block_rows: int = 1, num_warps: int = NUM_WARPS,
                                      interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """x [T, D] and 0-2 addends like it -> (x' = ((x + a) + m) rounded per add, LN(x') [T, D]),
    both in x.dtype; with no addends x' is x as given (no output of the kernel)."""
    problem = residual_layer_norm_blocks_problem(x, adds, scale, bias, block_rows)
    if problem is not None:
        raise ValueError(f"residual_layer_norm_blocks_kernel: {problem}")
    T, D = x.shape
    n_adds = len(adds)
    shape = jax.ShapeDtypeStruct((T, D), x.dtype)
    out = pl.pallas_call(
        functools.partial(_kernel, n_adds=n_adds, rows=T, width=D, block_rows=block_rows,
                          lanes=_pow2_at_least(D), eps=eps),
        out_shape=(shape, shape) if n_adds else (shape,),
        grid=(pl.cdiv(T, block_rows),),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kestrel_residual_layer_norm_blocks",
    )(x, *adds, scale, bias)
    return (out[0], out[1]) if n_adds else (x, out[0])


def residual_layer_norm_blocks_ref(x: jax.Array, adds: tuple[jax.Array, ...], scale: jax.Array, bias: jax.Array,
                                   *, eps: float) -> tuple[jax.Array, jax.Array]:
    """The model's expressions: the adds in order (each rounded to x's dtype), then
    `layers.layer_norm`."""
    for a in adds:
        x = x + a
    return x, layer_norm(x, scale, bias, eps)
