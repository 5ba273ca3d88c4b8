"""Routing for the dense (small-T) MoE regime as one Mosaic GPU kernel (routing="mosaic").

Not the default since the fourth session: `moe_route_triton` (XLA router GEMM + one Triton
program) is ~12 us faster per layer on an H100 (BENCHMARKS.md).

One CTA, one warpgroup, one launch replacing ~6 small XLA kernels (router GEMM, bias, top-k,
softmax, the block table): at decode batch sizes the MoE layer's time is mostly fixed per-kernel
cost, so launches matter more than the ~0.5 MB this kernel reads.

    logits [64 tok, E] = x_rows [<=64, D] @ router_w [D, E]      (wgmma, f32 accumulate)
    logits -> bf16, + bias in bf16 -> f32                         (the reference's roundings)
    top-k by repeated row max, ties to the lower expert id; softmax over the k maxima (f32)
    counts[e]  = ones[64, 64] @ selected[64 tok, E]              (wgmma: a column sum)
    block_of[e] = active[64, E] @ strictly_upper[E, E]            (wgmma: an exclusive prefix sum)
    block_expert[b] = #{e : block_of[e] + active[e] <= b}
    dest[s, t] = block_of[expert[t, s]] * Nt + t

Column sums and prefix sums are done as tiny MMAs because reductions across the rows of a
WGMMA-layout array are not a Mosaic GPU primitive, while reductions along rows are.
Tokens t >= num_valid select nothing. Outputs are [k, 64]-shaped (row s = the s-th choice of
every token) and two [1, 3, 64] block tables for the grouped GEMMs (B rows 0 for the up
projection, b * Nt for the down projection).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kestrel_jax.pallas import mgpu_interpret

TOKENS = 64  # wgmma M: all (<= 64) tokens of the dense regime in one tile
TILE_K = 128  # router GEMM K step (two 128-byte swizzle rows of bf16)
STAGES = 5  # 5 x (16 KB router weights + 16 KB token tile) in flight: what fits SMEM


class DenseRoute(NamedTuple):
    weights: jax.Array  # [k, 64] f32: softmax weight of each token's s-th expert
    experts: jax.Array  # [k, 64] int32
    dest: jax.Array  # [k, 64] int32: output row (block * Nt + token) of (token, s); 0 if invalid
    meta_up: jax.Array  # [1, 3, 64] int32: block expert, 0, [num_blocks, 0...]
    meta_down: jax.Array  # [1, 3, 64] int32: block expert, block * Nt, [num_blocks, 0...]


def route_dense_supported(num_tokens: int, dim: int, num_experts: int, top_k: int) -> bool:
    return (num_tokens <= TOKENS and dim % TILE_K == 0 and num_experts % 16 == 0
            and 16 <= num_experts <= TOKENS and 1 <= top_k <= num_experts)


def _transforms(cols: int) -> tuple:
    swizzle = plgpu.find_swizzle(cols * 16)
    # mypy sees these transforms' abstract base; they are concrete at runtime.
    return (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))  # type: ignore[abstract]


def route_dense(
    x_rows: jax.Array,  # [Nt, D] bf16, Nt <= 64 a multiple of 8 (token rows, zero padded)
    router_w: jax.Array,  # [D, E] bf16
    router_b: jax.Array,  # [E]
    num_valid: jax.Array,  # [1] int32: tokens >= it select nothing
    *,
    top_k: int,
    interpret: object = None,
) -> DenseRoute:
    nt, D = x_rows.shape
    E = router_w.shape[1]
    if not (route_dense_supported(nt, D, E, top_k) and nt % 8 == 0 and router_w.shape[0] == D):
        raise ValueError(f"route_dense: unsupported x {x_rows.shape}, router {router_w.shape}, top_k {top_k}")
    ks = D // TILE_K
    stages = min(STAGES, ks)
    f32 = jnp.float32
    wgmma_layout, rows_layout, cols_layout = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1), \
        plgpu.Layout.WGMMA.reduce(0)

    def body(x_ref, w_ref, b_ref, nv_ref, ones_ref, tri_ref,
             o_w, o_e, o_dest, o_meta_up, o_meta_down,
             x_buf, w_buf, bar, ones_smem, tri_smem, sel_smem, act_smem, cbar,
             v_w, v_e, v_dest, m_up, m_down):
        def fetch(s):
            slot = lax.rem(s, stages)
            # Only the Nt token rows are loaded; rows Nt..63 of the tile keep stale data, whose
            # logits rows are never used (every row >= num_valid <= Nt is masked below).
            plgpu.copy_gmem_to_smem(x_ref.at[:, pl.ds(s * TILE_K, TILE_K)], x_buf.at[slot, pl.ds(0, nt)],
                                    bar.at[slot])
            plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(s * TILE_K, TILE_K)], w_buf.at[slot], bar.at[slot])

        plgpu.copy_gmem_to_smem(ones_ref, ones_smem, cbar)
        plgpu.copy_gmem_to_smem(tri_ref, tri_smem, cbar)
        for s in range(stages):
            fetch(s)

        def gemm(acc):
            @pl.loop(0, ks)
            def _k(s):
                slot = lax.rem(s, stages)
                plgpu.barrier_wait(bar.at[slot])
                plgpu.wgmma(acc, x_buf.at[slot], w_buf.at[slot])
                plgpu.wgmma_wait(1)  # step s-1 done: its slot may be refilled

                @pl.when((s >= 1) & (s - 1 + stages < ks))
                def _():
                    fetch(s - 1 + stages)

            return acc[...]

        logits = pl.run_scoped(gemm, plgpu.ACC((TOKENS, E), f32))
        bias = plgpu.load(b_ref, layout=cols_layout, optimized=False).astype(f32)
        logits = logits.astype(jnp.bfloat16).astype(f32) + lax.broadcast_in_dim(bias, (TOKENS, E), [1])
        logits = logits.astype(jnp.bfloat16).astype(f32)

        col = plgpu.broadcasted_iota(jnp.int32, (TOKENS, E), 1, layout=wgmma_layout).astype(f32)
        tok = plgpu.broadcasted_iota(jnp.int32, (TOKENS, E), 0, layout=wgmma_layout)
        valid = tok < nv_ref[0]
        maxima, picks = [], []
        for _ in range(top_k):
            m = logits.max(axis=1)
            hit = logits == lax.broadcast_in_dim(m, (TOKENS, E), [0])
            idx = jnp.where(hit, col, float(E)).min(axis=1)  # lowest id among tied maxima
            logits = jnp.where(col == lax.broadcast_in_dim(idx, (TOKENS, E), [0]), -jnp.inf, logits)
            maxima.append(m)
            picks.append(idx)
        denom = sum(jnp.exp(m - maxima[0]) for m in maxima)
        selected = sum(jnp.where(col == lax.broadcast_in_dim(p, (TOKENS, E), [0]), 1.0, 0.0) for p in picks)
        selected = jnp.where(valid, selected, 0.0)  # `where`: stale rows may hold NaN

        plgpu.barrier_wait(cbar)
        sel_smem[...] = selected.astype(jnp.bfloat16)
        plgpu.commit_smem()

        def column_sum(acc):
            plgpu.wgmma(acc, ones_smem, sel_smem)  # [64, 64] @ [64 tok, E]: every row = counts
            return acc[...]

        active = jnp.where(pl.run_scoped(column_sum, plgpu.ACC((TOKENS, E), f32)) > 0.0, 1.0, 0.0)
        act_smem[...] = active.astype(jnp.bfloat16)
        plgpu.commit_smem()

        def prefix_sum(acc):
            plgpu.wgmma(acc, act_smem, tri_smem)  # [64, E] @ [E, E] strictly upper: exclusive sum
            return acc[...]

        block_of = pl.run_scoped(prefix_sum, plgpu.ACC((TOKENS, E), f32))
        upto = block_of + active  # active experts <= e, in every row
        row = plgpu.broadcasted_iota(jnp.int32, (TOKENS, E), 0, layout=wgmma_layout).astype(f32)
        block_expert = jnp.where(upto <= row, 1.0, 0.0).sum(axis=1).astype(jnp.int32)  # row b
        num_blocks = upto.max(axis=1).astype(jnp.int32)  # the same in every row
        t = plgpu.broadcasted_iota(jnp.int32, (TOKENS,), 0, layout=rows_layout)
        valid_t = t < nv_ref[0]
        for s, (m, p) in enumerate(zip(maxima, picks, strict=True)):
            blk = jnp.where(col == lax.broadcast_in_dim(p, (TOKENS, E), [0]), block_of, 0.0).sum(axis=1)
            v_w[s] = jnp.exp(m - maxima[0]) / denom
            v_e[s] = p.astype(jnp.int32)
            v_dest[s] = jnp.where(valid_t, blk.astype(jnp.int32) * nt + t, 0)
        count_row = jnp.where(t == 0, num_blocks, 0)
        m_up[0, 0] = block_expert
        m_up[0, 1] = jnp.minimum(t, 0)  # zeros; a splat constant of 64 elements cannot be stored
        m_up[0, 2] = count_row
        m_down[0, 0] = block_expert
        m_down[0, 1] = t * nt
        m_down[0, 2] = count_row
        plgpu.commit_smem()
        for src, dst in ((v_w, o_w), (v_e, o_e), (v_dest, o_dest), (m_up, o_meta_up), (m_down, o_meta_down)):
            plgpu.copy_smem_to_gmem(src, dst)
        plgpu.wait_smem_to_gmem(0)

    vec = jax.ShapeDtypeStruct((top_k, TOKENS), f32)
    ivec = jax.ShapeDtypeStruct((top_k, TOKENS), jnp.int32)
    meta = jax.ShapeDtypeStruct((1, 3, TOKENS), jnp.int32)
    kernel = plgpu.kernel(
        body,
        out_type=(vec, ivec, ivec, meta, meta),
        scratch_types=[
            plgpu.SMEM((stages, TOKENS, TILE_K), jnp.bfloat16, transforms=_transforms(TILE_K)),
            plgpu.SMEM((stages, TILE_K, E), jnp.bfloat16, transforms=_transforms(E)),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.SMEM((TOKENS, TOKENS), jnp.bfloat16, transforms=_transforms(TOKENS)),
            plgpu.SMEM((E, E), jnp.bfloat16, transforms=_transforms(E)),
            plgpu.SMEM((TOKENS, E), jnp.bfloat16, transforms=_transforms(E)),
            plgpu.SMEM((TOKENS, E), jnp.bfloat16, transforms=_transforms(E)),
            plgpu.Barrier(num_arrivals=2),
            plgpu.SMEM((top_k, TOKENS), f32),
            plgpu.SMEM((top_k, TOKENS), jnp.int32),
            plgpu.SMEM((top_k, TOKENS), jnp.int32),
            plgpu.SMEM((1, 3, TOKENS), jnp.int32),
            plgpu.SMEM((1, 3, TOKENS), jnp.int32),
        ],
        grid=(1,),
        grid_names=("cta",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=mgpu_interpret.resolve(interpret),
    )
    ones = jnp.ones((TOKENS, TOKENS), jnp.bfloat16)
    e_idx = jnp.arange(E)
    tri = (e_idx[:, None] < e_idx[None, :]).astype(jnp.bfloat16)  # [e', e] = e' < e
    w, e, dest, meta_up, meta_down = kernel(x_rows.astype(jnp.bfloat16), router_w.astype(jnp.bfloat16),
                                            router_b.astype(jnp.bfloat16), num_valid.astype(jnp.int32),
                                            ones, tri)
    return DenseRoute(w, e, dest, meta_up, meta_down)
