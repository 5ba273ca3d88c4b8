"""Token-to-expert grouping for the grouped-GEMM MoE kernels: sorted, block-aligned, on device.

Everything here is jnp on static shapes (the token count T is a compile-time bucket), so the
grouping runs inside the jitted step with no host round trip.

Two index spaces, both sized for the worst case of T:

* compact rows [C]: the T*k (token, expert) assignments sorted by expert (stable, so tokens
  keep their order inside an expert); each expert's run starts on a multiple of 8 because TMA
  loads into 8-row swizzled SMEM tiles need 8-aligned row starts. Arrays the kernels *read*
  row-wise (gathered tokens, quantised activations, per-row scales) live here.
* block rows [NB * Nt]: block b owns rows [b*Nt, (b+1)*Nt) and holds up to Nt consecutive
  assignments of one expert; row i of a block is that block's i-th assignment. Arrays the
  kernels *write* live here: each block is one whole TMA tile, so tiles never overlap. Rows
  past a block's last assignment are never written or read.

A block's compact rows are [block_row[b], block_row[b] + Nt): its assignments first, then
whatever follows (the next expert's rows or padding), whose results land in the block's
unused rows. C carries an Nt-row tail so that read never leaves the array.

Padding tokens (t >= num_valid_tokens) are given to no expert: they cost no weight reads,
`valid` is false for them and the combine step writes zeros for their rows.

Tried and removed (thirty-seventh session, H200, commit 7703136): the routing (top-k, softmax)
and this grouping as two Pallas Triton launches over 64-token tiles (per tile the picks, weights
and in-tile ranks, a cumulative sum down its [64, E] choice matrix; then every tile's offsets,
dest, the compact-row scatter and the block table). Exact agreement with this module, but the
launches took 11.3 and 43.7 us against ~25 us for XLA's top-k sort, softmax and ~15 fusions: FP8
layer T = 740 190.4 -> 228.6 us, T = 256 151.1 -> 204.9, the MD3 prefill step +5.3%.

`group_dense` is the small-T variant (T <= a few dozen): one block per *active* expert holding
all T tokens (padded to Nt), i.e. the kernels compute every token against every active expert
and the combine picks the routed pairs. No sort, no compact rows, no gathers: the MMA work it
wastes is free while the kernels stream weights, and the bookkeeping fits in two fusions.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

ROW_ALIGN = 8  # compact-row alignment of each expert's run (TMA tile rows)


class ExpertGrouping(NamedTuple):
    num_blocks: jax.Array  # [1] int32: blocks in use, a prefix of the block list
    block_expert: jax.Array  # [NB] int32: expert of each block (E for unused blocks)
    block_row: jax.Array  # [NB] int32: compact row of each block's first assignment (multiple of 8)
    row_token: jax.Array  # [C] int32: token of each compact row (0 for padding rows)
    row_block: jax.Array  # [C] int32: block row of each compact row (0 for padding rows)
    dest: jax.Array  # [T, k] int32: block row of each (token, slot) assignment
    valid: jax.Array  # [T, k] bool: false for padding tokens


def grouping_sizes(num_tokens: int, top_k: int, num_experts: int, block_tokens: int) -> tuple[int, int]:
    """Static (C, NB): compact rows and blocks for the worst case of T tokens."""
    a = num_tokens * top_k
    active = min(num_experts, a)
    compact = -(-(a + active * (ROW_ALIGN - 1)) // ROW_ALIGN) * ROW_ALIGN + block_tokens
    blocks = max(1, min(a, (a + active * (block_tokens - 1)) // block_tokens))
    return compact, blocks


class DenseGrouping(NamedTuple):
    num_blocks: jax.Array  # [1] int32: active experts
    block_expert: jax.Array  # [NB] int32: active experts in increasing order, then E
    dest: jax.Array  # [T, k] int32: block row of (token, slot) = block(expert) * Nt + token
    valid: jax.Array  # [T, k] bool: false for padding tokens


def _exclusive_cumsum(x: jax.Array, axis: int = 0) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


RANK_CHUNK = 128  # assignments per chunk of `_ranks`


def _ranks(key: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """Per-expert counts [E] and each assignment's rank among the earlier assignments of its
    expert [A] (a stable counting sort's positions; keys >= E count nowhere), without a sort:
    XLA's sort of the T*k keys took ~45-52 us of a 740-1544 token MoE layer on an H100 (tenth
    session). In chunks of RANK_CHUNK: a chunk-local rank from a masked [chunk, chunk]
    comparison, plus the counts of the earlier chunks (a cumsum over chunks of [chunks, E])."""
    (A,) = key.shape
    E, ch = num_experts, min(RANK_CHUNK, A)
    nc = -(-A // ch)
    kc = jnp.pad(key, (0, nc * ch - A), constant_values=E).reshape(nc, ch)
    i = jnp.arange(ch, dtype=jnp.int32)
    earlier = (kc[:, :, None] == kc[:, None, :]) & (i[None, None, :] < i[None, :, None])  # [nc, ch, ch]
    local = jnp.sum(earlier, axis=2, dtype=jnp.int32)  # [nc, ch]
    per_chunk = jnp.sum(kc[:, :, None] == jnp.arange(E, dtype=jnp.int32), axis=1, dtype=jnp.int32)  # [nc, E]
    before = _exclusive_cumsum(per_chunk, axis=0)  # [nc, E] assignments of each expert in earlier chunks
    base = jnp.take_along_axis(before, jnp.minimum(kc, E - 1), axis=1)  # [nc, ch]
    rank = (local + base).reshape(nc * ch)[:A]
    # Materialised: XLA otherwise fuses the [chunk, chunk] comparison into every consumer, among
    # them the layer's final combine, which then recomputed it for each of T*k*D output elements
    # (the combine went 21 -> 630 us at T = 1544 on an H100, tenth session).
    return lax.optimization_barrier((jnp.sum(per_chunk, axis=0), rank))


def _valid_mask(T: int, num_valid_tokens: jax.Array | int | None) -> jax.Array:
    if num_valid_tokens is None:
        return jnp.ones((T,), bool)
    return jnp.arange(T) < jnp.asarray(num_valid_tokens, jnp.int32)


def group_dense(
    experts: jax.Array,  # [T, k] int32 expert ids
    num_experts: int,
    block_tokens: int,  # Nt >= T
    num_valid_tokens: jax.Array | int | None = None,
) -> DenseGrouping:
    T, k = experts.shape
    E = num_experts
    if block_tokens < T:
        raise ValueError(f"dense grouping needs block_tokens >= T, got {block_tokens} < {T}")
    nb_max = min(E, T * k)
    valid = _valid_mask(T, num_valid_tokens)[:, None] & jnp.ones((1, k), bool)  # [T, k]
    e = jnp.arange(E, dtype=jnp.int32)
    hits = (experts[:, :, None] == e) & valid[:, :, None]  # [T, k, E]
    active = jnp.any(hits, axis=(0, 1))  # [E]
    # Block of each expert = number of active experts below it (a masked [E, E] sum, no cumsum).
    block_of = jnp.sum(active[:, None] & (e[:, None] < e[None, :]), axis=0, dtype=jnp.int32)  # [E]
    b = jnp.arange(nb_max, dtype=jnp.int32)
    # Experts with at most b active experts at or below them form a prefix; block b belongs to the
    # next one (and b >= the active count gives E).
    upto = block_of + active  # [E] active experts <= e
    block_expert = jnp.sum(upto[None, :] <= b[:, None], axis=1, dtype=jnp.int32)  # [NB]
    token = jnp.arange(T, dtype=jnp.int32)[:, None]
    dest = jnp.where(valid, block_of[jnp.clip(experts, 0, E - 1)] * block_tokens + token, 0)
    return DenseGrouping(jnp.sum(active, dtype=jnp.int32).reshape(1), block_expert.astype(jnp.int32),
                         dest.astype(jnp.int32), valid)


def group_by_expert(
    experts: jax.Array,  # [T, k] int32 expert ids (distinct within a row)
    num_experts: int,
    block_tokens: int,
    num_valid_tokens: jax.Array | int | None = None,  # [] int32; tokens >= it are padding
) -> ExpertGrouping:
    if block_tokens % ROW_ALIGN:
        raise ValueError(f"block_tokens must be a multiple of {ROW_ALIGN}, got {block_tokens}")
    T, k = experts.shape
    E, nt = num_experts, block_tokens
    C, NB = grouping_sizes(T, k, E, nt)
    A = T * k
    valid = jnp.repeat(_valid_mask(T, num_valid_tokens), k)
    key = jnp.where(valid, experts.reshape(A).astype(jnp.int32), E)  # padding: no expert

    counts, rank = _ranks(key, E)  # [E]; [A] index of each assignment inside its expert's run
    aligned = (counts + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN
    run_start = _exclusive_cumsum(aligned)  # [E] compact row of each expert's first assignment
    blocks = (counts + nt - 1) // nt  # [E]
    block_start = _exclusive_cumsum(blocks)  # [E]
    block_end = block_start + blocks
    num_blocks = jnp.sum(blocks).reshape(1)

    key_c = jnp.minimum(key, E - 1)
    row = jnp.where(valid, run_start[key_c] + rank, C)  # C: dropped by the scatter below
    dest = jnp.where(valid, (block_start[key_c] + rank // nt) * nt + rank % nt, 0)
    row, dest = lax.optimization_barrier((row, dest))  # computed once, not inside each consumer

    b = jnp.arange(NB, dtype=jnp.int32)
    # Experts whose blocks all end at or before b form a prefix; b belongs to the next one.
    block_expert = jnp.sum(block_end[None, :] <= b[:, None], axis=1, dtype=jnp.int32)
    be = jnp.minimum(block_expert, E - 1)
    block_row = jnp.clip(run_start[be] + (b - block_start[be]) * nt, 0, C - nt)

    # One scatter fills both per-compact-row maps (token, block row).
    a = jnp.arange(A, dtype=jnp.int32)
    rows = jnp.zeros((C, 2), jnp.int32).at[row].set(jnp.stack([a // k, dest], axis=1), mode="drop")
    row_token, row_block = rows[:, 0], rows[:, 1]
    return ExpertGrouping(
        num_blocks=num_blocks.astype(jnp.int32),
        block_expert=block_expert,
        block_row=block_row.astype(jnp.int32),
        row_token=row_token,
        row_block=row_block,
        dest=dest.reshape(T, k).astype(jnp.int32),
        valid=valid.reshape(T, k),
    )
