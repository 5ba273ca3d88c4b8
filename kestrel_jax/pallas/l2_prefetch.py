"""L2 prefetch of the weights a decode step reads next, issued from latency-bound kernels.

At batch 1 an MoE layer alternates weight-streaming GEMMs (QKV, output projection, the experts)
with kernels that hardly touch HBM (the QKV epilogue, attention over a short context, the split-KV
merge): ~10 us per layer in which the memory system idles. A kernel of the latter kind can issue
`cp.async.bulk.prefetch.L2` (TMA, fire-and-forget: no barrier, no SMEM) for the weights of the
GEMMs that follow it, so that they are streaming from HBM into L2 (50 MB on an H100) while the
latency-bound work runs, and the GEMMs then read them from L2.

Two kinds of target, both issued by every CTA of the host kernel for its share:

  whole arrays (`views`/`issue`): a weight read in full next (the output projection). Viewed as
      [R, 256] rows (a free reshape of a contiguous array), prefetched in boxes of `rb` rows
      spread over the CTAs.
  routed experts (`expert_view`/`issue_experts`): the up-projection weights of the experts the
      step's routing selected (the dense regime's block table `meta_up`: block -> expert, and the
      block count), viewed as [E, R, 256]; box u goes to CTA u mod n, blocks fastest, so the
      first rows of every selected expert are asked for first (the order the MoE kernel reads).

A prefetch changes no value: the interpreter treats it as a no-op, and the kernels' results are
tested with and without targets. Whether it pays is a GPU measurement (BENCHMARKS.md, twenty-
second session, H100, MD3 batch-1 step from decode attention): the selected experts' up weights
pay (the MoE GEMMs -60 to -75 us per token), but the prefetch traffic slows the latency-bound
kernels it overlaps (attention +0.5 to +1.6 us per layer, the split-KV merge +0.3); asking only
the first half of each expert's rows, once the CTA's own loads are consumed, kept the most (step
-42 us, W1 +1.9%). The output projection's weight did not pay (its GEMM, at 4.5 us for 8 MB, is
not bound by the stream; attention +1.3 us per layer). Nor did prefetches from the streaming
GEMMs themselves (call 6, patch in the benchmarks folder): the MoE up GEMM asking for the down
weights moved nothing, the down GEMM asking for the next layer's QKV weights made that GEMM
1.8 us faster per layer and itself 2.6 us slower.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kestrel_jax.pallas import lowering_cache

# one lowering per distinct kernel (lowering_cache.py); every kernel module imports this or mgpu_interpret
lowering_cache.install()

COLS = 256  # elements per view row: a TMA box dimension is at most 256 elements
MAX_BOX_ROWS = 256


def _box_rows(rows: int, n_ctas: int) -> int:
    """Rows per box: about one box per CTA, a power of two in [8, 256] dividing `rows`."""
    rb = 8
    while rb < MAX_BOX_ROWS and rb * n_ctas < rows and rows % (2 * rb) == 0:
        rb *= 2
    return rb


def viewable(a: jax.Array) -> bool:
    return a.size % (COLS * 8) == 0


def views(arrays: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """Each array as [R, 256] (arrays whose size does not allow it are left out)."""
    return tuple(a.reshape(a.size // COLS, COLS) for a in arrays if viewable(a))


def plan(rows: int, n_ctas: int) -> tuple[int, int]:
    """(rows per box, boxes per CTA) for a view of `rows` rows over `n_ctas` CTAs."""
    rb = _box_rows(rows, n_ctas)
    return rb, -(-(rows // rb) // n_ctas)


def issue(view_refs: Sequence[object], cta: jax.Array, n_ctas: int) -> None:
    """In a kernel body: this CTA's boxes of every [R, 256] view (box j goes to CTA j mod n)."""
    for ref in view_refs:
        rows = ref.shape[0]  # type: ignore[attr-defined]
        rb, per_cta = plan(rows, n_ctas)
        for i in range(per_cta):
            j = cta + i * n_ctas
            start = pl.multiple_of(jnp.minimum(j, rows // rb - 1) * rb, rb)
            plgpu.async_prefetch(ref.at[pl.ds(start, rb)], predicate=j < rows // rb)  # type: ignore[attr-defined]


def expert_view(up: jax.Array) -> jax.Array | None:
    """An [E, R, K] expert weight as [E, R * K / 256, 256] (None where that is not possible)."""
    if up.ndim != 3 or (up.shape[1] * up.shape[2]) % (COLS * 8) != 0:
        return None
    return up.reshape(up.shape[0], up.shape[1] * up.shape[2] // COLS, COLS)


def expert_box_rows(view_rows: int) -> int:
    """Rows per box of one expert's [R, 256] view: the largest power of two <= 256 dividing R."""
    rb = MAX_BOX_ROWS
    while view_rows % rb:
        rb //= 2
    return rb


def expert_unit(u: jax.Array, nb: jax.Array, per_expert: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Box u of the selected experts' weights: (block, box within the expert, whether u is one of
    the nb * per_expert boxes); blocks fastest, so every expert's first boxes come first."""
    nb1 = jnp.maximum(nb, 1)  # lax.div / rem: all operands >= 0 (jnp's floor division may not lower)
    return lax.rem(u, nb1), jnp.minimum(lax.div(u, nb1), per_expert - 1), u < nb * per_expert


def expert_units_per_cta(boxes_per_expert: int, n_ctas: int, max_blocks: int) -> int:
    return -(-max_blocks * boxes_per_expert // n_ctas)


def issue_experts(view_ref: object, meta_ref: object, cta: jax.Array, n_ctas: int, max_blocks: int,
                  part: int = 1) -> None:
    """In a kernel body: this CTA's boxes of the selected experts' weights (box u goes to CTA u mod
    n). `meta_ref` is the dense regime's [1, 3, 64] block table (row 0: block -> expert; [0, 2, 0]:
    the block count), at most `max_blocks` blocks; boxes of `expert_box_rows` view rows
    (`expert_unit`), of each expert the first 1 / `part` of its boxes (the rows the MoE kernel
    reads first)."""
    rows = view_ref.shape[1]  # type: ignore[attr-defined]
    rb = expert_box_rows(rows)
    boxes = max(1, rows // rb // part)
    nb = jnp.minimum(meta_ref[0, 2, 0], max_blocks)  # type: ignore[index]
    for i in range(expert_units_per_cta(boxes, n_ctas, max_blocks)):
        blk, sl, valid = expert_unit(cta + i * n_ctas, nb, boxes)
        expert = jnp.clip(meta_ref[0, 0, blk], 0, view_ref.shape[0] - 1)  # type: ignore[index,attr-defined]
        start = pl.multiple_of(sl * rb, rb)
        plgpu.async_prefetch(view_ref.at[expert, pl.ds(start, rb)], predicate=valid)  # type: ignore[attr-defined]
