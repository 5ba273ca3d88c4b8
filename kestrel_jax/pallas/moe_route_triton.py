"""Routing tables for the dense (small-T) MoE regime: one small Pallas Triton program.

The router GEMM itself stays in XLA (`moe.router_logits`, a [Nt, D] x [D, E] GEMM spread over
many SMs); this program takes its [P, E] logits (P = Nt rounded up to a power of two, at most a
few dozen rows) and does everything else in one launch:

    top-k by repeated row maxima (ties to the lower expert id; bf16 logits: one reduction per
    pick over packed (value, id) keys); softmax over the k maxima (f32)
    active[e]       = any valid token picked e                      (a column max)
    block_of[e]     = #{active e' < e}                              (a masked [E, E] row sum)
    block_expert[b] = #{e : block_of[e] + active[e] <= b}           (E for b >= #active)
    dest[s, t]      = block_of[expert[s, t]] * Nt + t               (0 for padding tokens)

Outputs have the layout of the Mosaic routing kernel (`moe_route_mgpu.DenseRoute`): [k, P]
arrays (row s = every token's s-th choice) and two [1, 3, E] block tables for the grouped GEMMs
(B rows 0 for the up projection, b * Nt for the down projection).

Why split it this way: one CTA streaming the 256 KB of router weights and then running ~26
reductions over a [64, 64] WGMMA-layout tile took ~20 us per layer on an H100 (BENCHMARKS.md,
third session), while the work after the GEMM is a few thousand compares. Triton's blocked
layout reduces along either axis inside a warp, and needs no TMA or wgmma for this.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kestrel_jax.pallas.moe_route_mgpu import DenseRoute

# H100 (fourth session), 64 rows: 4 warps 213 us layer, 8 warps 196; 1 row: equal. Seventeenth
# session, 1 and 8 rows: 1 / 2 / 4 / 8 warps 7.1 / 4.6 / 4.2 / 3.8 us, and with the packed-key top-k
# (bf16 logits) 3.03 us at 8 warps (4.46 / 3.53 at 4).
DEFAULT_WARPS = 8


def route_tables_supported(num_tokens: int, num_experts: int, top_k: int) -> bool:
    """Power-of-two expert counts (Triton block shapes) and a token tile of at most 64 rows."""
    return (1 <= num_tokens <= 64 and 16 <= num_experts <= 256 and num_experts & (num_experts - 1) == 0
            and 1 <= top_k <= num_experts)


def _packed_top_k(logits: jax.Array, col: jax.Array, top_k: int) -> tuple[list[jax.Array], list[jax.Array]]:
    """Top-k of bf16-exact f32 logits [P, E] with one max reduction per pick: each logit's bits
    mapped to an order-preserving int32 (negative floats: the 31 value bits flipped) keep their
    top 16 bits (a bf16 has no others) above 65535 - expert id, so the largest key is the largest
    logit and, among equal logits, the lowest id (-0.0 counts as +0.0; a row of -inf gives its
    lowest ids in order, as `lax.top_k`). The value comes back from the key's top bits."""
    i32 = jnp.int32
    bits = jax.lax.bitcast_convert_type(jnp.where(logits == 0, 0.0, logits), i32)  # -0.0 ties +0.0
    mono = jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    keys = ((mono >> 16) << 16) | (65535 - col)
    maxima, picks = [], []
    for _ in range(top_k):
        kmax = jnp.max(keys, axis=1)
        keys = jnp.where(keys == kmax[:, None], jnp.iinfo(i32).min, keys)
        hi = (kmax >> 16) << 16
        val_bits = jnp.where(hi < 0, hi ^ 0x7FFF0000, hi)
        maxima.append(jax.lax.bitcast_convert_type(val_bits, jnp.float32))
        picks.append(65535 - (kmax & 65535))
    return maxima, picks


def tables_program(logits_ref, nv_ref, w_ref, e_ref, dest_ref, mu_ref, md_ref, *, top_k: int, nt: int):
    """The program body (also run as one program of `qkv_epilogue.decode_qkv_route_kernel`): refs as
    `tables_io` lays them out."""
    f32, i32 = jnp.float32, jnp.int32
    P, E = logits_ref.shape
    logits = logits_ref[...].astype(f32)
    col = jax.lax.broadcasted_iota(i32, (P, E), 1)
    t = jax.lax.broadcasted_iota(i32, (P,), 0)
    valid_t = t < nv_ref[0]
    maxima: list[jax.Array] = []
    picks: list[jax.Array] = []
    if jnp.dtype(logits_ref.dtype) == jnp.dtype(jnp.bfloat16):
        maxima, picks = _packed_top_k(logits, col, top_k)
    else:
        for _ in range(top_k):
            m = jnp.max(logits, axis=1)
            idx = jnp.min(jnp.where(logits == m[:, None], col, E), axis=1)  # lowest id among tied maxima
            logits = jnp.where(col == idx[:, None], -jnp.inf, logits)
            maxima.append(m)
            picks.append(idx)
    chosen = functools.reduce(jnp.logical_or, [col == p[:, None] for p in picks])
    chosen = chosen & valid_t[:, None]  # padding rows (possibly NaN logits) pick nothing
    active = jnp.max(jnp.where(chosen, 1, 0), axis=0)  # [E] 0/1
    ee = jax.lax.broadcasted_iota(i32, (E, E), 0)  # row index: e (or b below)
    ec = jax.lax.broadcasted_iota(i32, (E, E), 1)  # column index: e'
    block_of = jnp.sum(jnp.where(ec < ee, active[None, :], 0), axis=1)  # [E] active experts below e
    upto = block_of + active  # active experts at or below e
    block_expert = jnp.sum(jnp.where(upto[None, :] <= ee, 1, 0), axis=1)  # [E] indexed by block b
    num_blocks = jnp.sum(active)

    denom = functools.reduce(jnp.add, [jnp.exp(m - maxima[0]) for m in maxima])
    for s, (m, p) in enumerate(zip(maxima, picks, strict=True)):
        blk = jnp.sum(jnp.where(col == p[:, None], block_of[None, :], 0), axis=1)
        w_ref[s, :] = jnp.where(valid_t, jnp.exp(m - maxima[0]) / denom, 0.0)
        e_ref[s, :] = jnp.where(valid_t, p, 0)
        dest_ref[s, :] = jnp.where(valid_t, blk * nt + t, 0)
    b = jax.lax.broadcasted_iota(i32, (E,), 0)
    count_row = jnp.where(b == 0, num_blocks, 0)
    for ref, rows in ((mu_ref, jnp.zeros((E,), i32)), (md_ref, b * nt)):
        ref[0, 0, :] = block_expert
        ref[0, 1, :] = rows
        ref[0, 2, :] = count_row


def route_tables(
    logits: jax.Array,  # [Nt, E] router logits (f32 or bf16), rows >= num_valid ignored
    num_valid: jax.Array,  # [1] int32
    *,
    top_k: int,
    block_tokens: int,  # Nt: the dense regime's block width (dest = block * Nt + token)
    num_warps: int | None = None,  # None: DEFAULT_WARPS
    interpret: bool = False,
) -> DenseRoute:
    ins, shapes = tables_io(logits, num_valid, top_k)
    w, e, dest, meta_up, meta_down = pl.pallas_call(
        functools.partial(tables_program, top_k=top_k, nt=block_tokens),
        out_shape=tuple(shapes),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps or DEFAULT_WARPS, num_stages=1),
        interpret=interpret,
        name="moe_route_tables",
    )(*ins)
    return DenseRoute(w, e, dest, meta_up, meta_down)


def tables_io(logits: jax.Array, num_valid: jax.Array, top_k: int
              ) -> tuple[list[jax.Array], list[jax.ShapeDtypeStruct]]:
    """`tables_program`'s inputs (the logits padded to P rows, a power of two >= 8, as Triton blocks
    want; num_valid as [1] int32) and its outputs' shapes ([k, P] weights, experts, dest; two
    [1, 3, E] block tables)."""
    nt, E = logits.shape
    if not route_tables_supported(nt, E, top_k):
        raise ValueError(f"route_tables: unsupported logits {logits.shape} with top_k {top_k}")
    P = max(8, 1 << (nt - 1).bit_length())
    if nt != P:
        logits = jnp.pad(logits, ((0, P - nt), (0, 0)))
    meta = jax.ShapeDtypeStruct((1, 3, E), jnp.int32)
    return ([logits, num_valid.astype(jnp.int32).reshape(1)],
            [jax.ShapeDtypeStruct((top_k, P), jnp.float32), jax.ShapeDtypeStruct((top_k, P), jnp.int32),
             jax.ShapeDtypeStruct((top_k, P), jnp.int32), meta, meta])
