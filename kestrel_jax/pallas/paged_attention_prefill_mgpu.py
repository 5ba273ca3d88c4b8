"""Mosaic GPU (Hopper) kernel for ragged paged prefill attention with a bidirectional prefix.

Same signature as `prefill_attention_ref` (plus keyword-only options); pool layout
[P, Hkv, S, D] as documented in `paged_attention.py`.

Work decomposition: the flattened queries of each sequence are cut into blocks of
wg_rows * num_consumers rows (a block never spans two sequences; the rows after cu_q_lens[B]
form one more pseudo-sequence whose blocks write zeros). Grid = (blocks upper bound, H); a CTA
finds its (sequence, block) by an unrolled scan of cu_q_lens. num_consumers + 1 warpgroups per
CTA (FlashAttention-3 shape; default 2 + 1):
  * the last WG (producer) TMA-gathers each `block_k`-key tile of K and V from the sequence's pages
    into a raw staging ring (`n_stage` slots, one TMA box per page chunk), converts it to the
    MMA operand type in registers (FP8 -> f16 is exact; dequantisation happens in the softmax
    scale), zeroes V rows past kv_len (pool garbage such as NaN must not meet a zero
    probability inside the MMA: 0 * NaN = NaN), and fills the operand ring (`n_op` slots,
    128-byte swizzle);
  * each consumer WG owns `wg_rows` query rows (64 or 128: one or two wgmma M tiles; every
    K/V tile brought into SMEM serves twice as many rows at 128): S = Q K^T and O += P V with
    wgmma (f16 operands for FP8 pools, bf16 for bf16 pools; f32 accumulators), online softmax
    in base 2 with sm_scale * log2(e) * k_scale folded into one multiply, v_scale applied once
    at the end. P feeds the PV wgmma straight from registers and the PV product accumulates
    into the running output registers (`p_in_registers`, `acc_in_place`: the GPU defaults; the
    interpreter stages P in SMEM and adds a fresh accumulator). Key tiles that no row of the
    warpgroup masks run without the mask; the others apply j < kv_len and
    (j <= pos or (pos < prefix and j < prefix)).
  * `pingpong` (two consumers): FA3's schedule barrier makes the warpgroups take turns, one
    issuing its MMAs while the other runs its softmax.
Q is TMA'd into a plain SMEM buffer and re-laid out through registers into the swizzled
operand buffer (a TMA into a swizzled buffer needs 8-aligned rows; ragged rows are not).
Output rows are staged in SMEM and stored with a ladder of power-of-two TMA boxes, so a block
stores exactly its own rows. Blocks at the end of the array start at T - block rows (their
first rows belong to the previous block and are recomputed but not stored).
`registers=(consumer, producer)` rebalances registers between the warpgroups (setmaxnreg);
128-row warpgroups need it (default (216, 72)): their S, P and O tiles do not fit in the even
share of 168. Prefills of at most 64 x num_consumers rows (a prompt appended to a cached image)
default to 64-row warpgroups: a second M tile would be padding.
`block_k`: keys per K/V tile, 64 or 128 (128 halves the loop trips; the default for three 64-row
consumers without a register split, 64 otherwise). `skip_tiles` (default on): a warpgroup only
waits for and releases the CTA's key tiles past its own rows' limit (a causal prompt's early rows
in a block with later ones), whose softmax update would be the identity.

Measured on an H100 (FP8 pool, page 64, kernel alone, BENCHMARKS.md): 740-token image prefill
29.8 us with 64-row warpgroups -> 23.1 us with 128 (96 CTAs, one wave) -> 20.7 us with three
64-row consumers (128 CTAs, still one wave; `prefill_schedule` picks the shape by size); 1024
tokens 33.7 -> 30.9 us; 16 x 740 tokens 340 -> 268 us. Ping-pong and the in-place PV are within
1-3 % either way at 128 rows (kept on: best or tied in the throughput case). On an H200
(fortieth session): 740 tokens 20.5-20.8 -> 19.5-19.8 us with 128-key tiles; 1024 tokens 28.8 ->
26.6 with `skip_tiles` (block 3's first three warpgroups skip 3, 2 and 1 of its 16 tiles) -> 25.8-26.0
with setmaxnreg (104, 64) for the four consumers, which also take a third staging slot (1024:
25.8-26.0 either way; as the multi-wave shape, the default since the forty-first session, 16 x 740
266.5 against 269.3-272.8 for two 128-row consumers). Not kept: FA3's intra-warpgroup
pipelining (S of tile t issued with tile t-1's PV product: 740 21.0 us, no gain anywhere, no spills
or serialised MMAs in ptxas's report; built and removed), a third operand slot, 128-key tiles at
other shapes (spills or two waves).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kestrel_jax.pallas.paged_attention import KVLayoutError, check_pool, is_fp8
from kestrel_jax.pallas.paged_attention_mgpu import (
    _NEG_INIT,
    _NUM_SMS,
    LOG2E,
    _interpret_params,
    _pad_page_table,
    own_buffer,
)
from kestrel_jax.switches import choice

DEFAULT_CONSUMERS = 2
WIDE_WG_ROWS = 128  # query rows per consumer warpgroup, unless the whole prefill fits 64 x consumers
_WIDE_REGISTERS = (216, 72)  # setmaxnreg split for 2 consumers x 128 rows (+ producer)
_FOUR_REGISTERS = (104, 64)  # ... and for 4 consumers x 64 rows (even share: 96)
BLOCK_K = 64  # keys per tile (the default of `block_k`)
_HEAD_DIM = 64
_SWIZZLE = 128  # bf16 rows of 64 are exactly 128 bytes
_F16_MAX = 65504.0
_ROW_VEC = plgpu.Layout.WGMMA.reduce(1)  # [64] per accumulator row
_COL_VEC = plgpu.Layout.WGMMA.reduce(0)  # [block_k] per accumulator column
_OP_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(_SWIZZLE))  # type: ignore[abstract]


def prefill_schedule(num_tokens: int, num_heads: int, num_sms: int = _NUM_SMS,
                     wide: str | None = None) -> tuple[int, int]:
    """(consumer warpgroups, rows per warpgroup) for a prefill of `num_tokens` flattened query
    rows (static) over `num_heads` heads. Three 64-row warpgroups where their blocks x heads fit
    in one wave of CTAs (a block of 192 rows costs less than one of 256), else four where those
    fit, else two 128-row ones (more rows per K/V tile converted: the cheaper rows once the CTAs
    queue in waves); two 64-row ones for short prefills (a prompt after a cached image). H100,
    seventeenth session, kernel alone, against two 128-row warpgroups: 740 tokens 23.1 -> 20.7 us
    (3 x 64); 1024 tokens 30.7 -> 29.0 (4 x 64; 3 x 64 would take two waves: 44.6); 16 x 740
    tokens 266.6 (3 x 64: 286.0, 4 x 64: 267.0). The key-tile size, register split and staging
    depth that go with each shape are chosen in `prefill_attention_kernel`. `wide` (default: the
    switch KESTREL_JAX_PREFILL_WIDE, read at trace time, "4x64") is the multi-wave shape: "4x64"
    (four 64-row consumers, three staging slots) ran the 16 x 740 case 1.0-1.6% faster than "2x128"
    (two 128-row consumers) on an H200 (fortieth session, kernel alone); in the engine (forty-first
    session, W2 at 64 clients, 1536-3072-token prefill steps) MD3 9,088 / 9,084 against 8,987 /
    9,100 output tok/s, MD2 10,030 against 10,000: within the runs' spread, no loss."""
    if num_tokens <= 64 * DEFAULT_CONSUMERS:
        return DEFAULT_CONSUMERS, 64
    for consumers in (3, 4):  # 64-row consumers while their blocks fit one wave
        if -(-num_tokens // (consumers * 64)) * num_heads <= num_sms:
            return consumers, 64
    if wide is None:
        wide = choice("KESTREL_JAX_PREFILL_WIDE", "4x64", ("2x128", "4x64"))
    return (4, 64) if wide == "4x64" else (DEFAULT_CONSUMERS, WIDE_WG_ROWS)


def prefill_attention_kernel_supported(q: jax.Array, k_pages: jax.Array, page_table: jax.Array) -> bool:
    """Shapes/dtypes the prefill kernel handles (the dispatcher falls back to the reference)."""
    if q.ndim != 3 or k_pages.ndim != 4 or page_table.ndim != 2:
        return False
    _, H, D = q.shape
    _, Hkv, S, Dk = k_pages.shape
    return (
        D == Dk == _HEAD_DIM
        and H % Hkv == 0
        and S >= 8
        and S & (S - 1) == 0
        and jnp.dtype(q.dtype) == jnp.dtype(jnp.bfloat16)
        and jnp.dtype(k_pages.dtype) in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.bfloat16))
    )


def _allowed_limit(pos: jax.Array, prefix: jax.Array) -> jax.Array:
    """Number of leading keys a query at `pos` sees (before clipping to kv_len); monotone in pos."""
    return jnp.where(pos < prefix, jnp.maximum(pos + 1, prefix), pos + 1)


def prefill_attention_kernel(
    q: jax.Array,  # [T, H, D] new tokens of all sequences, flattened in sequence order
    k_pages: jax.Array,  # [P, Hkv, S, D] (the new tokens' K/V already written)
    v_pages: jax.Array,  # [P, Hkv, S, D]
    cu_q_lens: jax.Array,  # [B + 1] int32 query offsets; rows >= cu_q_lens[B] are padding
    kv_lens: jax.Array,  # [B] int32 total tokens per sequence after this step (cached + new)
    page_table: jax.Array,  # [B, max_pages] int32
    prefix_lens: jax.Array,  # [B] int32 bidirectional prefix length (730 with an image, else 0)
    k_scale: jax.Array,  # [] f32
    v_scale: jax.Array,  # [] f32
    *,
    sm_scale: float,
    n_stage: int | None = None,  # None: 3 for four 64-row consumers, else 2
    n_op: int = 2,
    num_consumers: int | None = None,  # None: `prefill_schedule` (2 with wg_rows/registers/pingpong set)
    registers: tuple[int, int] | None = None,
    p_in_registers: bool | None = None,
    wg_rows: int | None = None,
    pingpong: bool | None = None,
    acc_in_place: bool | None = None,
    block_k: int | None = None,  # keys per K/V tile (64 default; 128 halves the loop trips)
    skip_tiles: bool = True,
    interpret: bool = False,
    detect_races: bool = False,
) -> jax.Array:  # [T, H, D] in q.dtype; padding rows are zero
    check_pool(k_pages, v_pages)
    if not prefill_attention_kernel_supported(q, k_pages, page_table):
        raise KVLayoutError(f"prefill kernel does not support q {q.shape} {q.dtype}, pool {k_pages.shape} "
                            f"{k_pages.dtype}; use prefill_attention_ref")
    B = kv_lens.shape[0]
    if cu_q_lens.shape != (B + 1,) or prefix_lens.shape != (B,) or page_table.shape[0] != B:
        raise KVLayoutError(f"cu_q_lens {cu_q_lens.shape}, prefix_lens {prefix_lens.shape}, page_table "
                            f"{page_table.shape} do not match kv_lens {kv_lens.shape}")
    if num_consumers is None:  # the schedule by size, unless the caller set the warpgroups' shape
        if wg_rows is None and registers is None and pingpong is None:
            num_consumers, wg_rows = prefill_schedule(q.shape[0], q.shape[1])
        else:
            num_consumers = DEFAULT_CONSUMERS
    if not 1 <= num_consumers <= 4:
        raise ValueError(f"num_consumers must be 1..4 warpgroups, got {num_consumers}")
    nc = num_consumers
    if wg_rows is None:  # a short append (a prompt after a cached image) needs no second M tile
        wg_rows = WIDE_WG_ROWS if q.shape[0] > 64 * nc else 64
    if wg_rows not in (64, 128):
        raise ValueError(f"wg_rows must be 64 or 128 (one or two wgmma M tiles), got {wg_rows}")
    if n_stage is None:  # four consumers: a third staging slot (H200: 16 x 740 -2%, 1024 unchanged)
        n_stage = 3 if (nc, wg_rows) == (4, 64) else 2
    if n_stage < 1 or n_op < 1:
        raise ValueError(f"n_stage and n_op must be >= 1, got {n_stage}, {n_op}")
    if block_k is None:  # 128-key tiles for three 64-row consumers at the launch's even register share
        block_k = 128 if (nc, wg_rows, registers) == (3, 64, None) else BLOCK_K
    if block_k not in (64, 128):
        raise ValueError(f"block_k (keys per K/V tile) must be 64 or 128, got {block_k}")
    if registers is None and wg_rows == 128 and nc == 2 and not interpret:
        registers = _WIDE_REGISTERS
    if registers is None and wg_rows == 64 and nc == 4 and not interpret:
        registers = _FOUR_REGISTERS
    if registers is not None:
        # setmaxnreg moves registers within the CTA's launch allocation (65536 / threads, in
        # multiples of 8, per thread): asking for more makes the consumers' increase wait forever.
        cap = (65536 // (128 * (nc + 1))) // 8 * 8
        r_con, r_pro = registers
        if (r_con % 8 or r_pro % 8 or not 24 <= r_pro <= r_con <= 256
                or nc * r_con + r_pro > (nc + 1) * cap):
            raise ValueError(f"registers={registers} for {nc} consumers: multiples of 8 in 24..256 with "
                             f"{nc} x consumer + producer <= {(nc + 1) * cap} (the launch allocation)")
    R = wg_rows
    block_q = nc * R
    # P feeds the PV wgmma from registers (FA3 style); the interpreter's wgmma reads A from SMEM
    # only, so interpreted runs stage P in SMEM (the GPU path differs by that one store).
    if p_in_registers is None:
        p_in_registers = not interpret
    if p_in_registers and interpret:
        raise ValueError("p_in_registers=True cannot be interpreted (the interpreter's wgmma reads A from SMEM)")
    # O += P V accumulating into the running output registers (one accumulator per warpgroup);
    # the interpreter has no register-initialised accumulator, so it adds a fresh one instead.
    if acc_in_place is None:
        acc_in_place = not interpret
    if acc_in_place and interpret:
        raise ValueError("acc_in_place=True cannot be interpreted (no register-initialised wgmma accumulator)")
    if pingpong is None:
        pingpong = nc == 2
    if pingpong and nc != 2:
        raise ValueError(f"pingpong scheduling needs exactly 2 consumer warpgroups, got {nc}")
    T0, H, D = q.shape
    P, Hkv, S, _ = k_pages.shape
    g = H // Hkv
    if block_q > T0:  # blocks are full-size TMA boxes; tiny prefills get padded rows
        q = jnp.pad(q, ((0, block_q - T0), (0, 0), (0, 0)))
    T = q.shape[0]
    page_table = _pad_page_table(page_table)
    maxp = page_table.shape[1]
    n_blocks = -(-T // block_q) + B  # >= sum of per-segment block counts over B + 1 segments
    copies = max(1, block_k // S)
    box = min(S, block_k)
    fp8 = is_fp8(k_pages.dtype)
    kv_dtype = k_pages.dtype
    # wgmma operand dtype. e4m3 -> f16 is exact and one instruction per pair (e4m3 -> bf16 needs
    # PTX ISA 9.2), and f16 keeps 3 more mantissa bits of Q and P than bf16.
    op_dtype = jnp.float16 if fp8 else jnp.bfloat16

    def body(q_ref, k_ref, v_ref, cu_ref, lens_ref, pt_ref, pre_ref, ks_ref, vs_ref, o_ref,
             q_smem, o_smem, k_stage, v_stage, k_op, v_op, pt_smem,
             q_bar, pt_bar, stage_bar, ready_bar, consumed_bar, sched_bar, *maybe_p_smem):
        p_smem = maybe_p_smem[0] if maybe_p_smem else None
        blk = lax.axis_index("blk")
        hq = lax.axis_index("h")
        wg = lax.axis_index("wg")
        hkv = hq // g

        # Unrolled scan over the B sequences plus the padding pseudo-sequence.
        seq = jnp.int32(-1)
        jblk = jnp.int32(0)
        seen = jnp.int32(0)
        for i in range(B + 1):
            lo = cu_ref[i]
            hi = cu_ref[i + 1] if i < B else jnp.int32(T)
            nb = (jnp.maximum(hi - lo, 0) + block_q - 1) // block_q
            here = (blk >= seen) & (blk < seen + nb)
            seq = jnp.where(here, i, seq)
            jblk = jnp.where(here, blk - seen, jblk)
            seen = seen + nb
        valid_blk = seq >= 0
        is_pad = seq == B
        b = jnp.clip(seq, 0, B - 1)
        qs = jnp.where(is_pad, cu_ref[B], cu_ref[b])
        qe = jnp.where(is_pad, jnp.int32(T), cu_ref[b + 1])
        kvl = jnp.where(is_pad, 0, lens_ref[b])
        pre = jnp.where(is_pad, 0, pre_ref[b])
        base = kvl - (qe - qs)  # position of the sequence's first new token
        r0 = qs + jblk * block_q
        r1 = jnp.minimum(r0 + block_q, qe)
        tile0 = jnp.minimum(r0, T - block_q)  # first row of the block's q tile
        kv_end = jnp.minimum(_allowed_limit(base + (r1 - 1 - qs), pre), kvl)
        n_tiles = jnp.where(valid_blk, (jnp.maximum(kv_end, 0) + block_k - 1) // block_k, 0)

        if registers is not None:  # always release (consumers' increase waits for it)
            pl.when(wg == nc)(functools.partial(plgpu.set_max_registers, registers[1], action="decrease"))

        @pl.when(valid_blk & (wg == nc))
        def _producer():
            plgpu.copy_gmem_to_smem(pt_ref.at[b], pt_smem, pt_bar)
            plgpu.barrier_wait(pt_bar)

            def issue(t, slot):
                for c in range(copies):
                    tok = t * block_k + c * box
                    page = jnp.clip(pt_smem[jnp.minimum(tok // S, maxp - 1)], 0, P - 1)
                    rows, dst = pl.ds(tok % S, box), pl.ds(c * box, box)
                    plgpu.copy_gmem_to_smem(k_ref.at[page, hkv, rows], k_stage.at[slot, dst], stage_bar.at[slot])
                    plgpu.copy_gmem_to_smem(v_ref.at[page, hkv, rows], v_stage.at[slot, dst], stage_bar.at[slot])

            for i in range(n_stage):
                pl.when(i < n_tiles)(functools.partial(issue, jnp.int32(i), jnp.int32(i)))
            key_ids = plgpu.broadcasted_iota(jnp.int32, (block_k,), 0, layout=_ROW_VEC)  # 2 registers per 64 keys

            @pl.loop(0, n_tiles)
            def _convert(t):
                s = lax.rem(t, n_stage)
                o = lax.rem(t, n_op)
                plgpu.barrier_wait(stage_bar.at[s])
                pl.when(t >= n_op)(lambda: plgpu.barrier_wait(consumed_bar.at[o]))
                kt = plgpu.load(k_stage.at[s], layout=plgpu.Layout.WGMMA, optimized=False)
                vt = plgpu.load(v_stage.at[s], layout=plgpu.Layout.WGMMA, optimized=False)
                k_op[o] = kt.astype(op_dtype)
                key_ok = lax.broadcast_in_dim(key_ids + t * block_k < kvl, (block_k, D), [0])
                v_op[o] = jnp.where(key_ok, vt.astype(op_dtype), 0)
                plgpu.commit_smem()
                plgpu.barrier_arrive(ready_bar.at[o])
                pl.when(t + n_stage < n_tiles)(lambda: issue(t + n_stage, s))

            # Observe the last consumer releases too (Pallas: a waiter waits on every phase).
            @pl.loop(jnp.maximum(n_tiles - n_op, 0), n_tiles)
            def _drain(t):
                plgpu.barrier_wait(consumed_bar.at[lax.rem(t, n_op)])

        @pl.when(wg < nc)
        def _consumer():
            if registers is not None:
                plgpu.set_max_registers(registers[0], action="increase")
            row0 = tile0 + wg * R  # first global row of this warpgroup's R rows
            own_lo = jnp.clip(r0 - row0, 0, R)
            own_hi = jnp.clip(r1 - row0, 0, R)
            n_own = jnp.where(valid_blk, jnp.maximum(own_hi - own_lo, 0), 0)
            # TMA into a tiled (swizzled) buffer needs 8-aligned rows; ragged rows are not, so q
            # lands in the plain output staging buffer and is re-laid out through registers.
            plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(row0, R), hq], o_smem.at[wg], q_bar.at[wg])
            scale = sm_scale * LOG2E * (ks_ref[...] if fp8 else 1.0)
            # Key tiles below the first owned row's limit need no mask (rows are monotone).
            first_pos = base + (row0 + own_lo - qs)
            n_full = jnp.where(n_own > 0, jnp.minimum(_allowed_limit(first_pos, pre), kvl) // block_k, 0)
            n_full = jnp.minimum(n_full, n_tiles)
            # Key tiles past the last owned row's limit are fully masked for every owned row: their
            # softmax update is exactly the identity (alpha 1, p 0). `skip_tiles` only waits for them
            # and releases them (the CTA's producer loads what its furthest-seeing warpgroup needs).
            last_pos = base + (row0 + own_hi - 1 - qs)
            n_mine = jnp.where(n_own > 0, (jnp.minimum(_allowed_limit(last_pos, pre), kvl) + block_k - 1) // block_k, 0)
            n_mine = jnp.clip(n_mine, n_full, n_tiles) if skip_tiles else n_tiles
            # Mask operands as a row vector (2 registers per thread per 64 rows) and a column vector
            # (16 per 64 keys), so nothing [R, block_k]-sized stays live across the key loop.
            pos = plgpu.broadcasted_iota(jnp.int32, (R,), 0, layout=_ROW_VEC) + (row0 - qs + base)
            row_sees_prefix = pos < pre
            plgpu.barrier_wait(q_bar.at[wg])
            q_in = plgpu.load(o_smem.at[wg], layout=plgpu.Layout.WGMMA, optimized=False)
            if op_dtype != q.dtype:  # f16 operands: clamp so |q| > 65504 cannot become inf
                q_in = jnp.clip(q_in.astype(jnp.float32), -_F16_MAX, _F16_MAX)
            q_smem[wg] = q_in.astype(op_dtype)
            plgpu.commit_smem()

            def schedule() -> None:  # FA3 ping-pong: wait until the other warpgroup has arrived too
                plgpu.barrier_arrive(sched_bar)
                plgpu.barrier_wait(sched_bar)

            def kv_step(t, carry, masked: bool):
                acc, m, den = carry
                o = lax.rem(t, n_op)
                plgpu.barrier_wait(ready_bar.at[o])

                def qk(ref):
                    plgpu.wgmma(ref, q_smem.at[wg], k_op.at[o].transpose((1, 0)))
                    if pingpong:  # let the other warpgroup issue its MMAs while this one waits for S
                        schedule()
                    return ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((R, block_k), jnp.float32)) * scale
                if masked:
                    shape = (R, block_k)
                    key = plgpu.broadcasted_iota(jnp.int32, (block_k,), 0, layout=_COL_VEC) + t * block_k
                    key_ok = lax.broadcast_in_dim(key < kvl, shape, [1])
                    in_prefix = lax.broadcast_in_dim(row_sees_prefix, shape, [0]) & lax.broadcast_in_dim(
                        key < pre, shape, [1])
                    causal = lax.broadcast_in_dim(key, shape, [1]) <= lax.broadcast_in_dim(pos, shape, [0])
                    s = jnp.where(key_ok & (causal | in_prefix), s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(axis=1))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                den = den * alpha + p.sum(axis=1)
                if acc_in_place:
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

                if p_smem is None:
                    p_op = p.astype(op_dtype)  # A operand straight from registers
                else:
                    p_smem[wg] = p.astype(op_dtype)
                    plgpu.commit_smem()
                    p_op = p_smem.at[wg]

                if pingpong:
                    # Finish the softmax before signalling it done, then wait for the tensor cores.
                    if p_smem is None:
                        acc, m_new, den, p_op = lax.optimization_barrier((acc, m_new, den, p_op))
                    else:
                        acc, m_new, den = lax.optimization_barrier((acc, m_new, den))
                    schedule()

                if acc_in_place:
                    def pv_acc(ref):
                        plgpu.wgmma(ref, p_op, v_op.at[o])

                    acc = pl.run_state(pv_acc)(plgpu.ACC.init(acc))
                    plgpu.barrier_arrive(consumed_bar.at[o])
                    return acc, m_new, den

                def pv(ref):
                    plgpu.wgmma(ref, p_op, v_op.at[o])
                    return ref[...]

                pv_t = pl.run_scoped(pv, plgpu.ACC((R, D), jnp.float32))
                plgpu.barrier_arrive(consumed_bar.at[o])
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv_t
                return acc, m_new, den

            init = (
                plgpu.layout_cast(jnp.full((R, D), 0.0, jnp.float32), plgpu.Layout.WGMMA),
                plgpu.layout_cast(jnp.full((R,), _NEG_INIT, jnp.float32), _ROW_VEC),
                plgpu.layout_cast(jnp.full((R,), 0.0, jnp.float32), _ROW_VEC),
            )
            if pingpong:  # warpgroup 1 starts one phase behind, so the two alternate on the tensor cores
                pl.when(wg == 1)(schedule)
            carry = lax.fori_loop(0, n_full, lambda t, c: kv_step(t, c, False), init)
            acc, _, den = lax.fori_loop(n_full, n_mine, lambda t, c: kv_step(t, c, True), carry)

            @pl.loop(n_mine, n_tiles)
            def _skip(t):
                o = lax.rem(t, n_op)
                plgpu.barrier_wait(ready_bar.at[o])
                if pingpong:  # keep the two warpgroups' turns in step
                    schedule()
                    schedule()
                plgpu.barrier_arrive(consumed_bar.at[o])
            if pingpong:  # ... and warpgroup 0 ends one phase later: both arrive 2 * n_tiles + 1 times
                pl.when(wg == 0)(schedule)
            inv = jnp.where(den > 0, (vs_ref[...] if fp8 else 1.0) / den, 0.0)
            o_smem[wg] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(o_smem.dtype)
            plgpu.commit_smem()
            # Store rows [own_lo, own_lo + n_own) with power-of-two boxes (TMA sizes are static).
            start = own_lo
            size = R
            while size >= 1:
                here = n_own & size
                src = o_smem.at[wg, pl.ds(start, size)]
                dst = o_ref.at[pl.ds(row0 + start, size), hq]
                pl.when(here != 0)(functools.partial(plgpu.copy_smem_to_gmem, src, dst))
                start = start + here
                size //= 2
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kern = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((T, H, D), q.dtype),
        grid=(n_blocks, H),
        grid_names=("blk", "h"),
        kernel_name="kestrel_prefill_attention",
        num_threads=nc + 1,
        thread_name="wg",
        scratch_types=[
            plgpu.SMEM((nc, R, D), op_dtype, transforms=_OP_TRANSFORMS),  # q
            plgpu.SMEM((nc, R, D), q.dtype),  # output staging (row-sliced by the stores)
            plgpu.SMEM((n_stage, block_k, D), kv_dtype),
            plgpu.SMEM((n_stage, block_k, D), kv_dtype),
            plgpu.SMEM((n_op, block_k, D), op_dtype, transforms=_OP_TRANSFORMS),
            plgpu.SMEM((n_op, block_k, D), op_dtype, transforms=_OP_TRANSFORMS),
            plgpu.SMEM((maxp,), jnp.int32),
            plgpu.Barrier(num_barriers=nc),
            plgpu.Barrier(),
            plgpu.Barrier(num_arrivals=2 * copies, num_barriers=n_stage),
            plgpu.Barrier(num_barriers=n_op),
            plgpu.Barrier(num_arrivals=nc, num_barriers=n_op),
            plgpu.Barrier(num_arrivals=2),  # ping-pong schedule between the two consumers
            *([] if p_in_registers else [plgpu.SMEM((nc, R, block_k), op_dtype, transforms=_OP_TRANSFORMS)]),
        ],
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=_interpret_params(interpret, detect_races),
    )
    out = kern(q, k_pages, v_pages, own_buffer(cu_q_lens, jnp.int32), own_buffer(kv_lens, jnp.int32), page_table,
               own_buffer(prefix_lens, jnp.int32), own_buffer(k_scale, jnp.float32), own_buffer(v_scale, jnp.float32))
    return out[:T0] if T0 != T else out

