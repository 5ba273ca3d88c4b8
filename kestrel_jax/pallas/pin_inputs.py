"""A step's small per-call inputs copied once, at the top of the step, by one kernel.

XLA replays each step as a CUDA graph (command buffer). With the SKIP_TEMP update mode
(`kestrel_jax/xla_defaults.py`) the graph's temporaries keep one address, but a step's host inputs
(token ids, positions, slots, page tables, sampling settings) are new buffers at every call, and
XLA updates every graph node that reads one before each launch. In an H200 trace of 64 concurrent
image queries (BENCHMARKS.md, thirtieth session) that cost 615 us of host time per mixed step (901
commands), 744 us per decode step (its outer graph) and 235 us per page copy (50 commands), while
the device waited; most of those nodes are the 24 layers' reads of the same few small arrays.

`pin` packs the inputs into one int32 word buffer (one XLA fusion reads them all) and copies it
with a Pallas Triton kernel, which XLA cannot fold away; everything downstream slices the kernel's
output, a temporary at a fixed address. Only the packing fusion and the copy read the new buffers.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

BLOCK = 1024  # words per program (a power of two, as Triton blocks want)
_WORD_DTYPES = ("int32", "uint32", "float32")


def _copy_program(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def copy_words(words: jax.Array, *, interpret: bool = False) -> jax.Array:
    """A copy of `words` [N] int32 (N a multiple of BLOCK) in a buffer of its own."""
    (n,) = words.shape
    if words.dtype != jnp.int32 or n % BLOCK:
        raise ValueError(f"copy_words wants int32 words in multiples of {BLOCK}; got {words.dtype}[{n}]")
    return pl.pallas_call(
        _copy_program,
        out_shape=jax.ShapeDtypeStruct((n,), jnp.int32),
        grid=(n // BLOCK,),
        in_specs=[pl.BlockSpec((BLOCK,), lambda i: (i,))],
        out_specs=pl.BlockSpec((BLOCK,), lambda i: (i,)),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="kestrel_pin_inputs",
    )(words)


def _as_words(x: jax.Array) -> jax.Array:
    if jnp.dtype(x.dtype).name not in _WORD_DTYPES:
        raise ValueError(f"pin takes {', '.join(_WORD_DTYPES)} arrays; got {x.dtype}{list(x.shape)}")
    flat = x.reshape(-1)
    return flat if flat.dtype == jnp.int32 else jax.lax.bitcast_convert_type(flat, jnp.int32)


def pin(arrays: Sequence[jax.Array | None], *, interpret: bool = False) -> list[jax.Array | None]:
    """`arrays` (int32, uint32 or float32; None passes through) as read from one kernel's output:
    the same values, shapes and dtypes."""
    live = [a for a in arrays if a is not None]
    if not live:
        return list(arrays)
    words = [_as_words(a) for a in live]
    total = sum(int(w.shape[0]) for w in words)
    padded = -(-total // BLOCK) * BLOCK
    packed = jnp.concatenate([*words, jnp.zeros((padded - total,), jnp.int32)])
    copied = copy_words(packed, interpret=interpret)
    out: list[jax.Array | None] = []
    offset = 0
    for a in arrays:
        if a is None:
            out.append(None)
            continue
        size = a.size
        w = jax.lax.slice(copied, (offset,), (offset + size,))
        offset += size
        if a.dtype != jnp.int32:
            w = jax.lax.bitcast_convert_type(w, a.dtype)
        out.append(w.reshape(a.shape))
    return out
