"""Mosaic GPU (Hopper) kernels for the paged KV cache: KV write and split-KV decode attention.

Same signatures as the references in `paged_attention.py` (plus keyword-only tuning
arguments); the pool layout is documented there ([P, Hkv, S, D], head-major pages). Every
`plgpu` call of the decode/write path lives in this file; prefill is in
`paged_attention_prefill_mgpu.py`.

write_kv_kernel: one CTA (one warpgroup) per new token. It loads the token's K and V rows
([Hkv * D], bf16) into registers, scales/clamps/casts them to the pool dtype, stages them in
SMEM and stores each with one TMA box [Hkv, D] into (page, :, row, :). The pools are passed as
mutable refs, so the custom call aliases them (in place when the caller donates the pool).

decode_attention_kernel: grid (B, Hkv, splits), one warpgroup per CTA. MD3 has no GQA
(group 1), so each query is a matrix-vector product: tensor cores would waste >= 8x, and
CUDA cores have the arithmetic to spare (~260 instructions per thread per 8 KiB tile against
~630 SM cycles of HBM time per tile). A CTA owns one KV head of one sequence and a contiguous
range of 64-row tiles; a tile is gathered with TMA (max(1, 64 / S) boxes of [min(S, 64), D]
per K and V, one barrier per slot, `depth` slots in flight; the page-table row is TMA'd into
SMEM first). Registers hold a tile as [64, 64] with every thread owning 16 consecutive
channels of two rows (layout `_ROWS`), so q.k reduces over 4 lanes only. Online softmax runs
per tile *row*: row r keeps its own running (max, sum, acc) for keys r, r + 64, r + 128, ...,
which keeps the inner loop free of cross-warp traffic; the 64 row states are merged once at
the end (the only cross-warp reduction). Only a sequence's last tile is masked. With
splits > 1 the CTAs write (o, log2-sum-exp) partials and a small XLA fusion merges them.
Defaults: splits only when B * Hkv < 132 (at most one CTA per SM), depth 8 when the grid is
under two CTAs per SM, else 4 (both capped by the tiles a split can have); 16-row tiles (8 of a
key row's 64 channels per thread, 55 registers instead of 127) in an eight-slot ring for unsplit grids over
short page tables (`decode_tile_plan`: B=32 at 128 tokens 12.1 -> 9.9 us on an H200).

Predicted H100 SXM times (HBM ~3.35 TB/s peak, ~3.0 TB/s copy; per-CTA fixed cost ~2-3 us:
kv_len and page-table loads, first TMA round trip, final merge), FP8 pool, page 64, defaults:
  B=1   KV 740 : 3 MB,   4 splits x 32 CTAs x 3 tiles   -> ~4 us + ~1.4 us merge (Kestrel 9.6)
  B=4   KV 740 : 12 MB,  128 CTAs x 12 tiles, no merge  -> ~8 us                 (Kestrel 17.1)
  B=8   KV 512 : 17 MB,  256 CTAs x 8 tiles, depth 8    -> ~5-6 us               (Kestrel 10.0)
  B=32  KV 128 : 17 MB,  1024 CTAs x 2 tiles            -> ~6-7 us               (Kestrel 11.8)
  B=64  KV 2048: 537 MB, 2048 CTAs x 32 tiles           -> ~200-220 us (80-90% of copy BW)
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.pallas import mosaic_gpu as plgpu

from kestrel_jax.pallas import l2_prefetch, mgpu_interpret
from kestrel_jax.pallas.paged_attention import FP8_MAX, KVLayoutError, check_pool, is_fp8

LOG2E = math.log2(math.e)
_NEG_INIT = -1e30  # finite "minus infinity" for running maxima: exp2(m - m) stays 1, never NaN
_TILE = 64  # decode tile rows: one page at the default page size, 2 rows per thread
_HEAD_DIM = 64
_NUM_SMS = 132  # H100 SXM; only used to size the grid heuristics

# [rows, 64] register layout: 4 warps x 8 lanes cover 32 rows, 4 lanes x 16 channels cover the
# 64 channels of a row; the 16 channels are 4 registers of 4 (cross-warp reductions of f32
# vectors are limited to 128 bits, and 4 x fp8 is one 32-bit shared-memory load).
_ROWS = plgpu.Layout.TILED(
    mgpu_fa.Tiling(((32, 64), (8, 64), (16,), (4,))),
    warp_dims=(-6,),
    lane_dims=(-4, -3),
    vector_dim=-1,
)
_ROW = _ROWS.reduce(1)  # [rows]: one value per row (replicated over the row's 4 lanes)
_CHAN = _ROWS.reduce(0)  # [64]: one value per channel
# 16-row tiles (`tile_rows=16`): 4 warps x 4 lanes cover 16 rows, 8 lanes x 8 channels a row, so a
# thread holds 8 channels of one row (a quarter of `_ROWS`' 16 channels of two rows; q.k reduces
# over 8 lanes).
_ROWS16 = plgpu.Layout.TILED(
    mgpu_fa.Tiling(((16, 64), (4, 64), (8,), (4,))),
    warp_dims=(-6,),
    lane_dims=(-4, -3),
    vector_dim=-1,
)
_TILE_ROWS = (64, 16)


def _tile_layouts(tile: int) -> tuple[Any, Any, Any]:
    """(tile [rows, 64], per-row [rows], per-channel [64]) register layouts for `tile` rows."""
    return (_ROWS16, _ROWS16.reduce(1), _ROWS16.reduce(0)) if tile == 16 else (_ROWS, _ROW, _CHAN)


def _interpret_params(interpret: bool, detect_races: bool) -> object:
    """The `interpret` argument of a Mosaic GPU kernel (None: compiled; `mgpu_interpret`)."""
    return mgpu_interpret.params(detect_races=detect_races) if interpret else None


def interpret_races_found() -> bool:
    """Whether the last kernel interpreted with detect_races=True reported a race."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    return bool(interpret_pallas_call.get_races().races_found)


# ----------------------------------------------------------------------------------- write


def write_kv_kernel_supported(k_pages: jax.Array, k: jax.Array) -> bool:
    """Shapes/dtypes the write kernel handles (the dispatcher falls back to the reference)."""
    _, H, S, D = k_pages.shape
    row_bytes = D * jnp.dtype(k_pages.dtype).itemsize
    return (
        k.ndim == 3
        and k.shape[1:] == (H, D)
        and (H * D) % 128 == 0
        and row_bytes % 16 == 0
        and jnp.dtype(k_pages.dtype) in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.bfloat16))
        and jnp.dtype(k.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
    )


def write_kv_kernel(
    k_pages: jax.Array,  # [P, Hkv, S, D]
    v_pages: jax.Array,  # [P, Hkv, S, D]
    k: jax.Array,  # [T, Hkv, D] post-rotary K
    v: jax.Array,  # [T, Hkv, D] post-tau V
    slots: jax.Array,  # [T] int32 flat slot; < 0 = padding row, not written
    k_scale: jax.Array,  # [] f32
    v_scale: jax.Array,  # [] f32
    *,
    interpret: bool = False,
    detect_races: bool = False,
) -> tuple[jax.Array, jax.Array]:
    check_pool(k_pages, v_pages)
    if k.shape != v.shape or slots.shape != k.shape[:1]:
        raise KVLayoutError(f"k {k.shape}, v {v.shape} and slots {slots.shape} disagree on [T, Hkv, D]")
    if not write_kv_kernel_supported(k_pages, k):
        raise KVLayoutError(f"write_kv_kernel does not support pool {k_pages.shape} {k_pages.dtype} "
                            f"with rows {k.shape} {k.dtype}; use write_kv_ref")
    P, H, S, D = k_pages.shape
    T = k.shape[0]
    fp8 = is_fp8(k_pages.dtype)
    vec = next(w for w in (8, 4, 2, 1) if (H * D) % (128 * w) == 0)
    layout = plgpu.Layout.WG_STRIDED((H, D), vec)  # each thread owns `vec` consecutive elements

    def body(k_ref, v_ref, slots_ref, ks_ref, vs_ref, kp_ref, vp_ref, k_smem, v_smem):
        t = lax.axis_index("t")
        slot = slots_ref[t]
        # The row loads do not depend on the slot: issue them before branching on it.
        for src, smem, sc_ref in ((k_ref, k_smem, ks_ref), (v_ref, v_smem, vs_ref)):
            x = plgpu.load(src.at[t], layout=layout, optimized=False).astype(jnp.float32)
            if fp8:
                x = jnp.clip(x / sc_ref[...], -FP8_MAX, FP8_MAX)  # IEEE divide: bit-equal to the reference
            smem[...] = x.astype(smem.dtype)
        plgpu.commit_smem()

        @pl.when(slot >= 0)
        def _():
            page = jnp.minimum(slot // S, P - 1)
            row = slot % S
            plgpu.copy_smem_to_gmem(k_smem, kp_ref.at[page, :, row, :], commit_group=False)
            plgpu.copy_smem_to_gmem(v_smem, vp_ref.at[page, :, row, :])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kern = plgpu.kernel(
        body,
        out_type=(),
        grid=(T,),
        grid_names=("t",),
        kernel_name="kestrel_write_kv",
        scratch_types=[plgpu.SMEM((H, D), k_pages.dtype), plgpu.SMEM((H, D), v_pages.dtype)],
        interpret=_interpret_params(interpret, detect_races),
    )
    k_ref = jax.new_ref(k_pages)
    v_ref = jax.new_ref(v_pages)
    kern(k, v, own_buffer(slots, jnp.int32), own_buffer(k_scale, jnp.float32), own_buffer(v_scale, jnp.float32),
         k_ref, v_ref)
    return jax.freeze(k_ref), jax.freeze(v_ref)


# ---------------------------------------------------------------------------------- decode


def decode_attention_kernel_supported(q: jax.Array, k_pages: jax.Array, page_table: jax.Array) -> bool:
    """Shapes/dtypes the decode kernel handles (the dispatcher falls back to the reference)."""
    if q.ndim != 3 or k_pages.ndim != 4 or page_table.ndim != 2:
        return False
    B, H, D = q.shape
    _, Hkv, S, Dk = k_pages.shape
    return (
        D == Dk == _HEAD_DIM
        and H % Hkv == 0
        and H // Hkv <= 4  # one register state (m, l, acc: ~36 regs) per query of the group
        and S >= 8
        and S & (S - 1) == 0
        and jnp.dtype(k_pages.dtype) in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.bfloat16))
        and jnp.dtype(q.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
    )


def default_num_splits(batch: int, n_kv_heads: int, max_tiles: int, num_sms: int = _NUM_SMS) -> int:
    """Split the KV range only when (batch x heads) CTAs leave most SMs idle, and then into at most
    one CTA per SM. (Until the fifteenth session ~2 CTAs per SM: at MD3's 32 heads and 740 tokens,
    H100 kernel times B=1: 6 splits 5.2 us, 2 splits 4.9; B=4: 3 splits 9.4 us, 1 split 8.3 with no
    merge after it.) KESTREL_JAX_DECODE_SPLITS overrides it for A/B runs: "old" (that rule) or a
    fixed count."""
    env = os.environ.get("KESTREL_JAX_DECODE_SPLITS", "")
    if env not in ("", "old") and not (env.isdigit() and int(env) > 0):
        raise ValueError(f"KESTREL_JAX_DECODE_SPLITS must be 'old' or a positive integer, got {env!r}")
    ctas = batch * n_kv_heads
    if env.isdigit():
        return min(max_tiles, int(env))
    if ctas >= num_sms:
        return 1
    if env == "old":
        return max(1, min(max_tiles, -(-2 * num_sms // ctas), 16))
    return max(1, min(max_tiles, num_sms // ctas, 16))


def own_buffer(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """`x` as a buffer of its own. Mosaic kernels require 256-byte aligned operands; a slice of
    a step's packed input (e.g. one column of a single-row int table) can reach a kernel as an
    unaligned view into that input, and a tiny parameter (a bias, a scale) may sit unaligned in
    device memory. An elementwise op XLA cannot fold makes it write a fresh, aligned buffer (XLA
    shares it between the layers that read the same value): for integers a clamp at -1, a no-op
    for every id, slot, length and page this project passes; for floats NaN -> 0."""
    x = jnp.asarray(x, dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.maximum(x, jnp.asarray(-1, dtype))
    return jnp.where(jnp.isnan(x), jnp.zeros((), dtype), x)


_PT_ALIGN = 4  # page-table row entries: the kernel TMA-copies a row into SMEM (16-byte stride)


def _pad_page_table(page_table: jax.Array) -> jax.Array:
    maxp = page_table.shape[1]
    if maxp % _PT_ALIGN:
        page_table = jnp.pad(page_table, ((0, 0), (0, _PT_ALIGN - maxp % _PT_ALIGN)))
    return own_buffer(page_table, jnp.int32)


def decode_attention_kernel(
    q: jax.Array,  # [B, H, D]
    k_pages: jax.Array,  # [P, Hkv, S, D]
    v_pages: jax.Array,  # [P, Hkv, S, D]
    kv_lens: jax.Array,  # [B] int32 valid tokens incl. the current one; 0 = inactive row
    page_table: jax.Array,  # [B, max_pages] int32
    k_scale: jax.Array,  # [] f32
    v_scale: jax.Array,  # [] f32
    *,
    sm_scale: float,
    num_splits: int | None = None,
    depth: int | None = None,
    prefetch: tuple[jax.Array, ...] = (),
    prefetch_experts: tuple[tuple[jax.Array, jax.Array], ...] = (),
    prefetch_max_blocks: int = 8,
    prefetch_late: bool = False,
    prefetch_expert_part: int = 1,
    partial_rows: int = 0,
    tile_rows: int | None = None,
    interpret: bool = False,
    detect_races: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:  # [B, H, D] in q.dtype; inactive rows are zero
    """`prefetch`: weights to ask into L2 while the CTAs run (`l2_prefetch.issue`: arrays read
    next by the step, e.g. the output projection); `prefetch_experts`: pairs (expert weights
    [E, R, K], the dense regime's block table for them: `meta_up` / `meta_down`) for the selected
    experts' weights (`l2_prefetch.issue_experts`, at most `prefetch_max_blocks` blocks; of each
    expert the first 1 / `prefetch_expert_part` of its rows). Asked at the start of each CTA
    (after its own first loads), or with `prefetch_late` once its loads are all consumed. None of
    it changes the result. With `partial_rows` >= B and more than one split (`planned_splits`), the
    split partials are returned unmerged, (o [partial_rows, H, splits, D] f32, lse [partial_rows, H,
    splits] f32; rows >= B unwritten), for a consumer that merges them itself
    (`gemv_mgpu.gemv_merged`). `tile_rows` (64 or 16): keys per load-ring tile; 16 holds 8 channels
    of one key row per thread in its own layout (`_ROWS16`) instead of 16 channels of two rows: 55 registers
    against 119-127, eight CTAs per SM, at four times the loop trips; None picks by shape
    (`decode_tile_plan`). (32-row tiles, one key row per thread at 79 registers, were slower than
    one of the two at every case timed on an H200, forty-first and forty-second sessions: built,
    measured and removed.) (Several KV heads of one sequence per CTA, on one
    load ring reduced head after head, were slower at every case on an H200, fortieth session, e.g.
    B=32 at 128 tokens 12.1 us at one head, 13.9 at two, 12.9 at four: built, measured and removed.)"""
    check_pool(k_pages, v_pages)
    if not decode_attention_kernel_supported(q, k_pages, page_table):
        raise KVLayoutError(f"decode kernel does not support q {q.shape} {q.dtype}, pool {k_pages.shape} "
                            f"{k_pages.dtype}; use decode_attention_ref")
    if kv_lens.shape != q.shape[:1] or page_table.shape[0] != q.shape[0]:
        raise KVLayoutError(f"kv_lens {kv_lens.shape} / page_table {page_table.shape} do not match B={q.shape[0]}")
    if depth is not None and depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    B, H, D = q.shape
    P, Hkv, S, _ = k_pages.shape
    g = H // Hkv
    if tile_rows is not None and tile_rows not in _TILE_ROWS:
        raise ValueError(f"tile_rows must be 64 or 16 (16 channels of two key rows per thread, or 8 of one), "
                         f"got {tile_rows}")
    tile, depth = decode_tile_plan(B, Hkv, page_table.shape[1], S, num_splits, tile_rows, depth)
    page_table = _pad_page_table(page_table)
    maxp = page_table.shape[1]
    max_tiles = -(-maxp * S // tile)
    splits = planned_splits(B, Hkv, maxp, S, num_splits, tile_rows=tile)
    per_split = -(-max_tiles // splits)
    unmerged = splits > 1 and partial_rows >= B
    out_rows = partial_rows if unmerged else B
    if depth is None:  # few CTAs must each keep more bytes in flight (counted in 64-row tiles)
        depth = (8 if B * Hkv * splits < 2 * _NUM_SMS else 4) * (_TILE // tile)
    depth = min(depth, per_split)  # short contexts need fewer slots (more CTAs fit in SMEM)
    copies = max(1, tile // S)  # TMA boxes per tile
    box = min(S, tile)  # rows per box
    fp8 = is_fp8(k_pages.dtype)
    rows_l, row_l, chan_l = _tile_layouts(tile)

    if splits == 1:
        out_type: tuple[jax.ShapeDtypeStruct, ...] = (jax.ShapeDtypeStruct((B, H, D), q.dtype),)
    else:
        out_type = (jax.ShapeDtypeStruct((out_rows, H, splits, D), jnp.float32),
                    jax.ShapeDtypeStruct((out_rows, H, splits), jnp.float32))

    pf_views = l2_prefetch.views(prefetch)
    pf_experts = [(ev, meta) for ev, meta in ((l2_prefetch.expert_view(w), meta) for w, meta in prefetch_experts)
                  if ev is not None]
    n_pf = len(pf_views) + 2 * len(pf_experts)

    def body(q_ref, k_ref, v_ref, lens_ref, pt_ref, ks_ref, vs_ref, *rest):
        pf_refs, rest = rest[:n_pf], rest[n_pf:]
        if splits == 1:
            (o_ref,), lse_ref = rest[:1], None
        else:
            o_ref, lse_ref = rest[:2]
        pt_smem, k_buf, v_buf, pt_bar, bars = rest[len(out_type):]
        b = lax.axis_index("b")
        h = lax.axis_index("h")
        s = lax.axis_index("s")
        plgpu.copy_gmem_to_smem(pt_ref.at[b], pt_smem, pt_bar)
        n = lens_ref[b]
        n_tiles = (n + tile - 1) // tile
        tiles_per_split = (n_tiles + splits - 1) // splits  # this sequence's split of its tiles
        first = s * tiles_per_split
        count = jnp.maximum(jnp.minimum(first + tiles_per_split, n_tiles) - first, 0)
        q_mult = sm_scale * LOG2E * (ks_ref[...] if fp8 else 1.0)
        v_mult = vs_ref[...] if fp8 else 1.0

        def issue(i: jax.Array, slot: jax.Array) -> None:
            t_idx = first + i  # this sequence's tile (of `tile` keys)
            for c in range(copies):
                tok = t_idx * tile + c * box
                page = jnp.clip(pt_smem[jnp.minimum(tok // S, maxp - 1)], 0, P - 1)
                rows = pl.ds(tok % S, box)
                dst = pl.ds(c * box, box)
                plgpu.copy_gmem_to_smem(k_ref.at[page, h, rows], k_buf.at[slot, dst], bars.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[page, h, rows], v_buf.at[slot, dst], bars.at[slot])

        qs = []
        for j in range(g):
            qv = plgpu.load(q_ref.at[b, h * g + j], layout=chan_l, optimized=False).astype(jnp.float32)
            qs.append(lax.broadcast_in_dim(qv * q_mult, (tile, D), (1,)))
        plgpu.barrier_wait(pt_bar)
        for i in range(depth):
            pl.when(i < count)(functools.partial(issue, jnp.int32(i), jnp.int32(i)))

        def ask_l2():
            cta = (b * Hkv + h) * splits + s
            n_ctas = B * Hkv * splits
            l2_prefetch.issue(pf_refs[:len(pf_views)], cta, n_ctas)
            for i in range(len(pf_experts)):
                w_ref, meta_ref = pf_refs[len(pf_views) + 2 * i:len(pf_views) + 2 * i + 2]
                l2_prefetch.issue_experts(w_ref, meta_ref, cta, n_ctas, prefetch_max_blocks, prefetch_expert_part)

        if n_pf and not prefetch_late:  # behind this CTA's own first loads (its critical path)
            ask_l2()

        row_ids = plgpu.broadcasted_iota(jnp.int32, (tile,), 0, layout=row_l)
        init = tuple(
            (plgpu.layout_cast(jnp.full((tile,), _NEG_INIT, jnp.float32), row_l),
             plgpu.layout_cast(jnp.full((tile,), 0.0, jnp.float32), row_l),
             plgpu.layout_cast(jnp.full((tile, D), 0.0, jnp.float32), rows_l))
            for _ in range(g)
        )

        def step(i, carry, masked: bool):
            slot = lax.rem(i, depth)
            plgpu.barrier_wait(bars.at[slot])
            kt = plgpu.load(k_buf.at[slot], layout=rows_l, optimized=False).astype(jnp.float32)
            vt = plgpu.load(v_buf.at[slot], layout=rows_l, optimized=False).astype(jnp.float32)
            if masked:
                valid = row_ids + (first + i) * tile < n
                # Rows past kv_len may hold anything (NaN in tests): select, never multiply, them away.
                vt = jnp.where(lax.broadcast_in_dim(valid, (tile, D), (0,)), vt, 0.0)
            new = []
            for j in range(g):
                m, den, acc = carry[j]
                sc = jnp.sum(kt * qs[j], axis=1)
                if masked:
                    sc = jnp.where(valid, sc, -jnp.inf)
                m_new = jnp.maximum(m, sc)
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(sc - m_new)
                den = den * alpha + p
                acc = (acc * lax.broadcast_in_dim(alpha, (tile, D), (0,))
                       + lax.broadcast_in_dim(p, (tile, D), (0,)) * vt)
                new.append((m_new, den, acc))
            pl.when(i + depth < count)(functools.partial(issue, i + depth, slot))
            return tuple(new)

        # Only the sequence's last tile can be partial: every other tile runs without masks.
        full = jnp.minimum(count, jnp.maximum(n // tile - first, 0))
        final = lax.fori_loop(0, full, functools.partial(step, masked=False), init)
        final = lax.fori_loop(full, count, functools.partial(step, masked=True), final)
        if n_pf and prefetch_late:
            ask_l2()
        for j in range(g):
            m, den, acc = final[j]
            m_all = jnp.max(m, axis=0)
            w = jnp.exp2(m - m_all)
            l_all = jnp.sum(den * w, axis=0)
            o = jnp.sum(acc * lax.broadcast_in_dim(w, (tile, D), (0,)), axis=0)
            inv = jnp.where(l_all > 0, v_mult / l_all, 0.0)
            if lse_ref is None:
                o_ref.at[b, h * g + j][...] = (o * inv).astype(o_ref.dtype)
            else:
                o_ref.at[b, h * g + j, s][...] = o * inv
                lse_ref[b, h * g + j, s] = jnp.where(l_all > 0, m_all + jnp.log2(l_all), -jnp.inf)

    kern = plgpu.kernel(
        body,
        out_type=out_type,
        grid=(B, Hkv, splits),
        grid_names=("b", "h", "s"),
        kernel_name="kestrel_decode_attention",
        scratch_types=[
            plgpu.SMEM((maxp,), jnp.int32),
            plgpu.SMEM((depth, tile, D), k_pages.dtype),
            plgpu.SMEM((depth, tile, D), v_pages.dtype),
            plgpu.Barrier(),
            plgpu.Barrier(num_arrivals=2 * copies, num_barriers=depth),
        ],
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=4096),
        interpret=_interpret_params(interpret, detect_races),
    )
    outs = kern(q, k_pages, v_pages, own_buffer(kv_lens, jnp.int32), page_table,
                own_buffer(k_scale, jnp.float32), own_buffer(v_scale, jnp.float32), *pf_views,
                *(a for pair in pf_experts for a in pair))
    if splits == 1:
        return outs[0]
    if unmerged:
        return outs[0], outs[1]
    return merge_splits(outs[0], outs[1], q.dtype)


_SHORT_TABLE_ROWS = 256  # key rows a page table covers at most for `decode_tile_plan`'s 16-row tiles


def decode_tile_plan(batch: int, n_kv_heads: int, max_pages: int, page_size: int, num_splits: int | None = None,
                     tile_rows: int | None = None, depth: int | None = None) -> tuple[int, int | None]:
    """(tile rows, depth or None for the kernel's default) for `decode_attention_kernel`. Unless
    given: 16-row tiles in an eight-slot ring (128 keys in flight) where the grid needs no splits
    and the page table (before the kernel pads it) covers at most 128 keys, or at most 256 keys
    with two to eight CTAs per SM; 64-row tiles otherwise. H200, kernel alone, forty-second session:
    B=32 at 128 tokens 9.9 us (two runs) against 11.8 for 32-row tiles at four slots (the
    forty-first session's plan) and 12.1 for 64-row tiles; ptxas: 55 registers against 79 and
    119-127, so eight CTAs fit per SM and the 1,024 CTAs run as one wave. At 128 keys or fewer the
    16-row tiles won at every grid timed (B=8 at 64 / 128 keys 3.3 / 4.8 against 3.8 / 5.2, B=16,
    64, 128 at 128 keys 6.5 / 17.2 / 31.4 against 7.6 / 20.9 / 38.2); at 256 keys only from 512
    to 1,024 CTAs (B=16 / 32: 9.3 / 15.6 against 10.0 / 16.0), not at 256 (B=8: 7.0 against 6.4)
    or from 2,048 (B=64 / 128: 28.1 / 51.8 against 27.0 / 48.8). Longer tables keep 64-row tiles:
    16-row ones were slower at B=8 and 512 tokens (10.8-11.5 against 8.8 us), B=4 and 740
    (13.1-13.6 against 7.4), B=1 and 740 (4.9-5.2 against 4.1-4.2) and B=64 at 896 (79.6-85.8
    against 66.6-66.9)."""
    if tile_rows is not None:
        return tile_rows, depth
    keys, ctas = max_pages * page_size, batch * n_kv_heads
    short = keys <= _SHORT_TABLE_ROWS // 2 or (keys <= _SHORT_TABLE_ROWS and 2 * _NUM_SMS <= ctas <= 8 * _NUM_SMS)
    if short and planned_splits(batch, n_kv_heads, max_pages, page_size, num_splits) == 1:
        return 16, 8 if depth is None else depth
    return _TILE, depth


def planned_splits(batch: int, n_kv_heads: int, max_pages: int, page_size: int, num_splits: int | None = None,
                   *, tile_rows: int = _TILE) -> int:
    """The split count `decode_attention_kernel` runs with (page tables padded as it pads them)."""
    max_pages = -(-max_pages // _PT_ALIGN) * _PT_ALIGN
    max_tiles = -(-max_pages * page_size // tile_rows)
    splits = max(1, min(num_splits or default_num_splits(batch, n_kv_heads, max_tiles), max_tiles))
    per_split = -(-max_tiles // splits)
    return -(-max_tiles // per_split)  # no split left empty by construction at full length


def merge_splits(o: jax.Array, lse: jax.Array, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """o [..., splits, D] normalised partials, lse [..., splits] log2-sum-exp2 -> [..., D] dtype.

    The split count is small and static, so the merge is written as an unrolled elementwise
    expression over static slices (max, exp2 weights, weighted sum, normalise, cast): XLA emits
    one loop fusion for all of it. A variadic lax.reduce also gave one reduction kernel but left
    the normalise-and-cast as a second one (1.1 us per layer call at B=1 on an H100)."""
    n = o.shape[-2]
    parts = [o[..., s, :].astype(jnp.float32) for s in range(n)]
    lses = [lse[..., s, None].astype(jnp.float32) for s in range(n)]
    top = functools.reduce(jnp.maximum, lses)
    safe = jnp.where(jnp.isfinite(top), top, 0.0)
    ws = [jnp.where(jnp.isfinite(x), jnp.exp2(x - safe), 0.0) for x in lses]  # empty split: weight 0
    den = functools.reduce(jnp.add, ws)
    acc = functools.reduce(jnp.add, [w * p for w, p in zip(ws, parts, strict=True)])
    return (acc / jnp.where(den > 0, den, 1.0)).astype(dtype)
