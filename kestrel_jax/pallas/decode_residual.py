"""The decode MoE layer's output before its weighted sum: the expert rows and their combine.

At decode on a GPU the MoE layer comes out of the down GEMM unreduced: each token's k expert
output rows and its softmax weights (`ExpertRows`, the routing tables' layout). `combine_rows` is
the weighted sum as the model forms it (XLA fuses it into the parallel block's residual add);
`layer_norm_triton.residual_layer_norm_rows_kernel` forms it in the next layer's LayerNorm launch
instead (opt-in).

History: a two-launch Pallas Triton residual kernel (the split-K projection partials summed, both
residual adds, the next LayerNorm) lived here from the seventh session, opt-in behind
KESTREL_JAX_DECODE_RESIDUAL: it measured slower then (its two launches 5.2 us per layer against
5.0 for XLA's, MD3 batch-1 596 vs 608 tok/s) and no faster in the twentieth session (batch-1
step +2.6 us), where the one-launch residual + LayerNorm kernel replaced it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class ExpertRows(NamedTuple):
    """An unreduced MoE output in the routing tables' layout: token t's j-th choice is row
    dest[j, t] of y with weight weights[j, t]; tokens t >= n_valid (padding) contribute nothing.
    out[t] = sum_j weights[j, t] * y[dest[j, t]]."""

    y: jax.Array  # [R, D] expert output rows
    dest: jax.Array  # [k, P] int32, P >= T
    weights: jax.Array  # [k, P] f32
    n_valid: jax.Array  # [1] int32
    # f32 partials [splits, N, Mp] of a side product streamed in the down GEMM's launch (the attention
    # output projection, `moe_mgpu.SideProduct`), or None
    side: jax.Array | None = None


def combine_rows(r: ExpertRows, tokens: int, dtype: jnp.dtype) -> jax.Array:
    """out[t] = sum_j w[j, t] * y[dest[j, t]] in f32 for t < tokens (NaN-safe `where` for padding
    tokens and rows no kernel wrote), in dtype: one gather-multiply-reduce fusion. (Reading the
    [k, T] tables without transposing them, as k gathers added in order, measured no faster on
    the H100: it saved the two transpose kernels per MoE layer, 2.9 us at 64 rows, and XLA's
    gather fusion grew by as much; twelfth session. Rebuilt and measured again on the H200,
    thirty-third session, MD3 decode step: 1 row +0.1%, 8 rows +0.9%, 32 rows -0.9%; removed again.
    At 8 rows this fusion is an 8 us transpose-style reduction because it also sums the output
    projection's split-K partials, laid out [splits, N, rows].)"""
    dest, w = r.dest[:, :tokens].T, r.weights[:, :tokens].T.astype(jnp.float32)[..., None]
    valid = (jnp.arange(tokens) < r.n_valid[0])[:, None, None]
    yk = jnp.where(valid, w * r.y[dest].astype(jnp.float32), 0.0)  # [T, k, D]
    return jnp.sum(yk, axis=1).astype(dtype)
