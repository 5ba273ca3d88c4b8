"""Routing and expert grouping for the sorted (prefill-size) MoE regime in two Pallas Triton launches.

The sorted regime groups a prefill's T * k (token, expert) assignments by expert into blocks of Nt
rows (`moe_grouping.group_by_expert`). In jnp that is a top-k (a sort), a softmax and ~15 small
fusions for the counting sort's ranks, cumulative sums, scatters and the block table: ~25 us per
MoE layer at T = 740 on an H200 (thirty-third session's `bench_moe.py` kernel list), where Kestrel's
whole routing took ~9 us on the same GPU. Here the same results come from two launches over token
tiles of TT rows (router logits [T, E] in, the grouping out):

  pick, grid (tiles,): per token the top-k logits (ties to the lower expert id), their softmax
      (f32), and each assignment's rank among the earlier assignments of its expert *inside the
      tile* (a cumulative sum down the tile's [TT, E] choice matrix); per tile the count of each
      expert. Padding tokens (t >= num_valid) choose nothing. Each program also zero-fills its
      share of the two compact-row maps, which the second launch scatters into.
  place, grid (tiles,): every program reads the [tiles, E] counts (a few KB) and forms the
      per-expert totals, its tile's offsets (the counts of earlier tiles), each expert's run start
      (8-aligned) and first block; then each assignment's compact row and block row (`dest`), the
      scatter of (token, block row) into the compact-row maps, and (program 0) the block table in
      `moe_mgpu._meta`'s layout.

Results equal `route_ref` + `group_by_expert` + `_meta` (tests/pallas/test_moe_sort.py): the
same experts, dest, block table and compact-row maps, weights within float rounding of
jax.nn.softmax (the sum runs in another order).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kestrel_jax.pallas.moe_grouping import ROW_ALIGN, grouping_sizes
from kestrel_jax.pallas.moe_route_triton import _packed_top_k

TILE_TOKENS = 64  # TT: tokens per program
MAX_BLOCKS = 256  # one chunk of `moe_mgpu._meta` (META_CHUNK)
DEFAULT_WARPS = 4


class SortedRoute(NamedTuple):
    """Routing and grouping of the sorted regime, `[k, T]`-major where per assignment."""

    weights: jax.Array  # [k, T] f32 softmax weights (0 for padding tokens)
    experts: jax.Array  # [k, T] int32 expert ids (0 for padding tokens)
    dest: jax.Array  # [k, T] int32 block row of each assignment (0 for padding tokens)
    row_token: jax.Array  # [C] int32 token of each compact row (0 for padding rows)
    row_block: jax.Array  # [C] int32 block row of each compact row (0 for padding rows)
    meta: jax.Array  # [1, 3, CH] int32 block table (`moe_mgpu._meta`)


def sorted_route_problem(num_tokens: int, num_experts: int, top_k: int, block_tokens: int,
                         dtype: jnp.dtype) -> str | None:
    """Why `sorted_route` cannot run these shapes (None: it can)."""
    if num_experts & (num_experts - 1) or not 16 <= num_experts <= 256:
        return f"expert count {num_experts} is not a power of two in [16, 256]"
    if not 1 <= top_k <= num_experts:
        return f"top_k {top_k} out of [1, {num_experts}]"
    if block_tokens & (block_tokens - 1) or block_tokens < ROW_ALIGN:
        return f"block_tokens {block_tokens} is not a power of two >= {ROW_ALIGN}"
    if num_tokens < 1:
        return "no tokens"
    if grouping_sizes(num_tokens, top_k, num_experts, block_tokens)[1] > MAX_BLOCKS:
        return f"more than {MAX_BLOCKS} blocks (one block-table chunk)"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return f"logits dtype {dtype} is not bf16 or f32"
    return None


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _top_k(logits: jax.Array, col: jax.Array, top_k: int, bf16: bool) -> tuple[list, list]:
    if bf16:
        return _packed_top_k(logits, col, top_k)
    E = logits.shape[1]
    maxima, picks = [], []
    for _ in range(top_k):
        m = jnp.max(logits, axis=1)
        idx = jnp.min(jnp.where(logits == m[:, None], col, E), axis=1)  # lowest id among tied maxima
        logits = jnp.where(col == idx[:, None], -jnp.inf, logits)
        maxima.append(m)
        picks.append(idx)
    return maxima, picks


def _pick_program(logits_ref, nv_ref, w_ref, e_ref, lr_ref, cnt_ref, rt_ref, rb_ref, *, top_k: int, T: int,
                  zero_chunk: int, bf16: bool):
    i32 = jnp.int32
    p = pl.program_id(0)
    E = logits_ref.shape[1]
    t = p * TILE_TOKENS + lax.broadcasted_iota(i32, (TILE_TOKENS,), 0)
    in_range = t < T
    col = lax.broadcasted_iota(i32, (TILE_TOKENS, E), 1)
    logits = pltriton.load(logits_ref.at[pl.ds(p * TILE_TOKENS, TILE_TOKENS), :],
                           mask=in_range[:, None] & (col >= 0), other=0.0).astype(jnp.float32)
    valid = in_range & (t < nv_ref[0])
    maxima, picks = _top_k(logits, col, top_k, bf16)
    chosen = functools.reduce(jnp.logical_or, [col == k_[:, None] for k_ in picks]) & valid[:, None]
    ones = jnp.where(chosen, 1, 0)
    before = lax.cumsum(ones, axis=0) - ones  # [TT, E] earlier choices of each expert in this tile
    denom = functools.reduce(jnp.add, [jnp.exp(m - maxima[0]) for m in maxima])
    cols = pl.ds(p * TILE_TOKENS, TILE_TOKENS)
    for s_, (m, k_) in enumerate(zip(maxima, picks, strict=True)):
        s = p * 0 + s_  # a traced row index: masked stores at a literal one fail in the interpreter
        rank = jnp.sum(jnp.where(col == k_[:, None], before, 0), axis=1)
        pltriton.store(w_ref.at[s, cols], jnp.where(valid, jnp.exp(m - maxima[0]) / denom, 0.0), mask=in_range)
        pltriton.store(e_ref.at[s, cols], jnp.where(valid, k_, 0), mask=in_range)
        pltriton.store(lr_ref.at[s, cols], jnp.where(valid, rank, 0), mask=in_range)
    cnt_ref[p, :] = jnp.sum(ones, axis=0)
    # This program's share of the compact-row maps, zeroed for the place launch's scatter.
    z = p * zero_chunk + lax.broadcasted_iota(i32, (zero_chunk,), 0)
    zeros = jnp.where(z < 0, 1, 0)
    C = rt_ref.shape[0]
    pltriton.store(rt_ref.at[pl.ds(p * zero_chunk, zero_chunk)], zeros, mask=z < C)
    pltriton.store(rb_ref.at[pl.ds(p * zero_chunk, zero_chunk)], zeros, mask=z < C)


def _gather_e(vec: jax.Array, idx: jax.Array, col: jax.Array) -> jax.Array:
    """vec[idx] for a per-expert vector [E] and ids [R] (a masked row sum over [R, E])."""
    return jnp.sum(jnp.where(col == idx[:, None], vec[None, :], 0), axis=1)


def _place_program(e_ref, lr_ref, cnt_ref, nv_ref, rt_in, rb_in, dest_ref, rt_ref, rb_ref, meta_ref, *,
                   top_k: int, T: int, nt: int, n_tiles: int, n_blocks: int):
    del rt_in, rb_in  # aliased to rt_ref / rb_ref
    i32 = jnp.int32
    p = pl.program_id(0)
    E = cnt_ref.shape[1]
    C = rt_ref.shape[0]
    ntp = max(2, _pow2(n_tiles))
    tile = lax.broadcasted_iota(i32, (ntp, E), 0)
    counts_t = pltriton.load(cnt_ref.at[pl.ds(0, ntp), :], mask=tile < n_tiles, other=0)
    counts = jnp.sum(counts_t, axis=0)  # [E]
    base = jnp.sum(jnp.where(tile < p, counts_t, 0), axis=0)  # [E] earlier tiles' assignments
    ee = lax.broadcasted_iota(i32, (E, E), 0)
    ec = lax.broadcasted_iota(i32, (E, E), 1)
    aligned = (counts + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN
    run_start = jnp.sum(jnp.where(ec < ee, aligned[None, :], 0), axis=1)  # [E] exclusive cumsum
    blocks = (counts + nt - 1) // nt
    block_start = jnp.sum(jnp.where(ec < ee, blocks[None, :], 0), axis=1)

    t = p * TILE_TOKENS + lax.broadcasted_iota(i32, (TILE_TOKENS,), 0)
    in_range = t < T
    valid = in_range & (t < nv_ref[0])
    col = lax.broadcasted_iota(i32, (TILE_TOKENS, E), 1)
    cols = pl.ds(p * TILE_TOKENS, TILE_TOKENS)
    for s_ in range(top_k):
        s = p * 0 + s_  # a traced row index (as in the pick program)
        e = pltriton.load(e_ref.at[s, cols], mask=in_range, other=0)
        rank = _gather_e(base, e, col) + pltriton.load(lr_ref.at[s, cols], mask=in_range, other=0)
        row = _gather_e(run_start, e, col) + rank
        dest = (_gather_e(block_start, e, col) + rank // nt) * nt + rank % nt
        pltriton.store(dest_ref.at[s, cols], jnp.where(valid, dest, 0), mask=in_range)
        ok = valid & (row < C)
        row = jnp.where(ok, row, 0)
        pltriton.store(rt_ref.at[row], t, mask=ok)
        pltriton.store(rb_ref.at[row], dest, mask=ok)

    @pl.when(p == 0)
    def _table():
        ch = meta_ref.shape[2]
        nbp = max(2, _pow2(ch))
        b = lax.broadcasted_iota(i32, (nbp,), 0)
        bc = lax.broadcasted_iota(i32, (nbp, E), 1)
        block_end = block_start + blocks
        # Experts whose blocks all end at or before b form a prefix; b belongs to the next one.
        block_expert = jnp.sum(jnp.where(block_end[None, :] <= b[:, None], 1, 0), axis=1)
        be = jnp.minimum(block_expert, E - 1)
        block_row = jnp.clip(_gather_e(run_start, be, bc) + (b - _gather_e(block_start, be, bc)) * nt, 0, C - nt)
        used = b < n_blocks  # `_meta` pads past the static block count with zeros
        num_blocks = jnp.sum(blocks)
        rows = b < ch
        zero = p  # a traced 0 (this is program 0): masked stores at literal indices fail in the interpreter
        for r, v in enumerate((jnp.where(used, block_expert, 0), jnp.where(used, block_row, 0),
                               jnp.where(b == 0, num_blocks, 0))):
            pltriton.store(meta_ref.at[zero, zero + r, pl.ds(0, nbp)], v, mask=rows)


def sorted_route(
    logits: jax.Array,  # [T, E] router logits (bf16 or f32)
    num_valid: jax.Array,  # [1] int32: tokens >= it are padding
    *,
    top_k: int,
    block_tokens: int,  # Nt of the sorted regime
    num_warps: int = DEFAULT_WARPS,
    interpret: bool = False,
) -> SortedRoute:
    T, E = logits.shape
    problem = sorted_route_problem(T, E, top_k, block_tokens, logits.dtype)
    if problem is not None:
        raise ValueError(f"sorted_route: {problem}")
    C, NB = grouping_sizes(T, top_k, E, block_tokens)
    ch = -(-NB // 8) * 8  # `_meta`'s one-chunk width
    n_tiles = -(-T // TILE_TOKENS)
    zero_chunk = _pow2(-(-C // n_tiles))
    i32, f32 = jnp.int32, jnp.float32
    nv = num_valid.astype(i32).reshape(1)
    params = pltriton.CompilerParams(num_warps=num_warps, num_stages=1)
    w, e, lr, cnt, rt, rb = pl.pallas_call(
        functools.partial(_pick_program, top_k=top_k, T=T, zero_chunk=zero_chunk,
                          bf16=jnp.dtype(logits.dtype) == jnp.dtype(jnp.bfloat16)),
        out_shape=(jax.ShapeDtypeStruct((top_k, T), f32), jax.ShapeDtypeStruct((top_k, T), i32),
                   jax.ShapeDtypeStruct((top_k, T), i32), jax.ShapeDtypeStruct((n_tiles, E), i32),
                   jax.ShapeDtypeStruct((C,), i32), jax.ShapeDtypeStruct((C,), i32)),
        grid=(n_tiles,),
        compiler_params=params,
        interpret=interpret,
        name="moe_sort_pick",
    )(logits, nv)
    dest, rt, rb, meta = pl.pallas_call(
        functools.partial(_place_program, top_k=top_k, T=T, nt=block_tokens, n_tiles=n_tiles, n_blocks=NB),
        out_shape=(jax.ShapeDtypeStruct((top_k, T), i32), jax.ShapeDtypeStruct((C,), i32),
                   jax.ShapeDtypeStruct((C,), i32), jax.ShapeDtypeStruct((1, 3, ch), i32)),
        grid=(n_tiles,),
        input_output_aliases={4: 1, 5: 2},
        compiler_params=params,
        interpret=interpret,
        name="moe_sort_place",
    )(e, lr, cnt, nv, rt, rb)
    return SortedRoute(w, e, dest, rt, rb, meta)
