"""Mosaic GPU (Hopper) GEMM for decode-size activations: y = x @ w with few rows of x.

At decode a projection reads its whole weight for a handful of rows, so its time is the weight
stream. XLA tiles a [1..8, 2048] x [2048, 2048] product into a few dozen CTAs and streams the
8 MB at 0.5-0.8 TB/s (BENCHMARKS.md, fifth session); this kernel splits both the output columns
and the reduction so that every SM streams.

Layout: w [K, N] as the model stores it (`Linear.kernel`, N contiguous), x [M, K]. Swap-AB: each
CTA computes a [64, Mp] block of y^T = w^T x^T with wgmma, A = a [BK, 64] weight tile read
transposed (bf16 wgmma takes an MN-major A from SMEM), B = the [Mp, BK] x tile (K-major),
Mp = M rounded up to 8 (the wgmma N). Grid (N / 64 column blocks, `splits` K ranges); each CTA
runs a TMA ring of `stages` slots over its K range in steps of 64 rows and writes its f32
partial [64, Mp] block of y^T to out[split]. The caller sums the splits and transposes (a few
elementwise adds that XLA fuses into the consumer of the product, with the bias add and the
cast).

Used by the attention projections of MoE layers at decode (`models/text.py`). H100, fifth
session, 24 cold weights, us per GEMM with the split-sum as its own kernel: proj [2048, 2048]
6.0 (1 row) / 6.2 (8 rows) vs XLA 15.8 / 10.2; QKV [2048, 6144] 11.4 / 11.8 vs 12.1 / 10.6; the
bigger dense-layer and LM-head products stream at 73-92% of copy bandwidth, below XLA's 79-100%.
MD3 batch-1 decode 539 -> 557 tok/s with it, 572 with the router product riding in the QKV
launch (`gemv_pair`).

`gemv_rows` is the unsplit variant that finishes its rows itself (bias, bf16, [Mp, N] row-major):
for products whose consumers are kernels, which XLA cannot fuse the split sum into. H100,
seventeenth session: an MoE layer's QKV + router product at batch 1 in one launch instead of three
(the pair kernel and XLA's two sums, 40 launches fewer per token); W1 607.0 -> 619.1 tok/s.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.pallas import mosaic_gpu as plgpu

from kestrel_jax.pallas.moe import gelu_erf_poly
from kestrel_jax.pallas.paged_attention_mgpu import _interpret_params

BLOCK_N = 64  # output columns per CTA: the wgmma M of one warpgroup
BLOCK_K = 64  # weight rows per pipeline step: one 128-byte swizzle row of bf16
MAX_ROWS = 64  # largest M handled (the wgmma N of the swap-AB product is Mp <= 64 here)
_NUM_SMS = 132
_SMEM_LIMIT = 232448  # bytes of dynamic SMEM per block on H100/H200 (what Mosaic checks)
_SWIZZLE = 128
# mypy sees these transforms' abstract base; they are concrete at runtime.
_TRANSFORMS = (plgpu.TilingTransform((8, _SWIZZLE // 2)), plgpu.SwizzleTransform(_SWIZZLE))  # type: ignore[abstract]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Gate:
    """A decode GEMM's gate: where `table[row, column]` is 0 the kernel streams nothing and the
    product is zero (just the bias): a product the step does not need this time, decided on the
    device without a host round trip. `table` is traced; row and column are static (part of the
    pytree's structure, so a jitted caller keys its cache on them)."""

    table: jax.Array  # 2-D int32
    row: int = dataclasses.field(metadata={"static": True})
    column: int = dataclasses.field(metadata={"static": True})


def gemv_supported(x: jax.Array, w: jax.Array) -> bool:
    """Shapes/dtypes the kernel handles (callers fall back to jnp.dot)."""
    if x.ndim != 2 or w.ndim != 2:
        return False
    M, K = x.shape
    K2, N = w.shape
    return (K == K2 and 1 <= M <= MAX_ROWS and K % BLOCK_K == 0 and N % BLOCK_N == 0
            and jnp.dtype(x.dtype) == jnp.dtype(jnp.bfloat16) and jnp.dtype(w.dtype) == jnp.dtype(jnp.bfloat16))


def default_splits(K: int, N: int, num_sms: int = _NUM_SMS) -> int:
    """K ranges per column block: enough CTAs for ~2 per SM, at least 4 steps (256 rows) each."""
    steps = K // BLOCK_K
    blocks = N // BLOCK_N
    s = 1
    while blocks * s < 2 * num_sms and steps % (2 * s) == 0 and steps // (2 * s) >= 4:
        s *= 2
    return s


def _fill(fetch, n_stages: int) -> None:
    for i in range(n_stages):
        fetch(jnp.int32(i), jnp.int32(i))


def _stream(acc_ref, w_buf, x_buf, bars, fetch, steps: int, n_stages: int, resident: bool = False,
            row_major: bool = False, prepare: Any = None) -> None:
    """The K loop both kernels run: fill the `n_stages`-slot TMA ring (`fetch(step, slot)`), then
    per step wait for its slot, y^T block [64, Mp] += (w tile [BK, 64])^T @ (x tile [Mp, BK])^T
    (`row_major`, at Mp = 64: y block [64, 64] += x tile @ w tile, no swap), and refill the slot of
    the previous step once its MMA is done. With `resident`, x_buf holds every step's x tile
    (formed in the kernel) and the ring, filled by the caller, carries weights only; `prepare(i)`,
    if given, forms step i's x tile at the top of its step, before the wait for its weight tile."""
    if not resident:
        _fill(fetch, n_stages)

    @pl.loop(0, steps)
    def _step(i):
        slot = lax.rem(i, n_stages)
        if prepare is not None:
            prepare(i)
        plgpu.barrier_wait(bars.at[slot])
        x_tile = x_buf.at[i] if resident else x_buf.at[slot]
        if row_major:
            plgpu.wgmma(acc_ref, x_tile, w_buf.at[slot])
        else:
            plgpu.wgmma(acc_ref, w_buf.at[slot].T, x_tile.T)
        plgpu.wgmma_wait(1)  # step i-1's MMA is done: its slot may be refilled

        @pl.when((i >= 1) & (i - 1 + n_stages < steps))
        def _refill():
            fetch(i - 1 + n_stages, lax.rem(i - 1, n_stages))

    plgpu.wgmma_wait(0)


# Register layout of an [8, 64] bf16 x tile formed in the kernel (`merge`): 4 warps x 2 rows,
# 32 lanes x 2 channels, which stores into the swizzled wgmma operand tile.
_XROWS = plgpu.Layout.TILED(mgpu_fa.Tiling(((8, 64), (2, 64), (2,))), warp_dims=(-5,), lane_dims=(-2,),
                            vector_dim=-1)


def merge_supported(o: jax.Array | jax.ShapeDtypeStruct, lse: jax.Array | jax.ShapeDtypeStruct,
                    w: jax.Array | jax.ShapeDtypeStruct) -> bool:
    """Split-KV attention partials the merged-input GEMM takes: o [8, H, S, 64] f32, lse [8, H, S]
    f32, w [H * 64, N] bf16 (one head per K step)."""
    return (o.ndim == 4 and o.shape[0] == 8 and o.shape[3] == BLOCK_K and lse.shape == o.shape[:3]
            and o.dtype == jnp.float32 and lse.dtype == jnp.float32 and w.ndim == 2
            and w.shape[0] == o.shape[1] * BLOCK_K and w.shape[1] % BLOCK_N == 0
            and jnp.dtype(w.dtype) == jnp.dtype(jnp.bfloat16))


def _row_tile(row_ref, tile_ref, cols, mp: int) -> None:
    """An x tile [mp, 64] formed in the kernel from columns `cols` of an SMEM row [K] (row 0; the
    padding rows zero), through `_XROWS`, the layout that stores into the swizzled operand tile."""
    row = plgpu.broadcasted_iota(jnp.int32, (mp, BLOCK_K), 0, layout=_XROWS)
    v = plgpu.load(row_ref.at[cols], layout=_XROWS.reduce(0), optimized=False)
    t = lax.broadcast_in_dim(v, (mp, BLOCK_K), (1,))
    tile_ref[...] = jnp.where(row == 0, t, jnp.zeros_like(t))


def _merged_tile(o_ref, lse_ref, head, rows: int, n_splits: int) -> jax.Array:
    """Rows [0, 8) of head `head`'s attention output, merged from its split partials as
    `paged_attention_mgpu.merge_splits` does (rows >= `rows` zero), as bf16 in `_XROWS`."""
    lses = [plgpu.load(lse_ref.at[:, head, s], layout=_XROWS.reduce(1), optimized=False)
            for s in range(n_splits)]
    top = functools.reduce(jnp.maximum, lses)
    safe = jnp.where(top > -jnp.inf, top, 0.0)
    ws = [jnp.where(x > -jnp.inf, jnp.exp2(x - safe), 0.0) for x in lses]  # empty split: weight 0
    den = functools.reduce(jnp.add, ws)

    def rows_of(v):
        return lax.broadcast_in_dim(v, (8, BLOCK_K), (0,))

    acc = functools.reduce(jnp.add, [
        rows_of(ws[s]) * plgpu.load(o_ref.at[:, head, s, :], layout=_XROWS, optimized=False)
        for s in range(n_splits)])
    row = plgpu.broadcasted_iota(jnp.int32, (8, BLOCK_K), 0, layout=_XROWS)
    return jnp.where(row < rows, acc / rows_of(jnp.where(den > 0, den, 1.0)), 0.0).astype(jnp.bfloat16)


def gemv_partials(
    x: jax.Array | None,  # [M, K] bf16, M <= 64 (None with `merge`)
    w: jax.Array,  # [K, N] bf16
    w2: jax.Array | None = None,  # [K, N2] bf16: a second product of the same x, same launch
    *,
    splits: int | None = None,
    stages: int = 4,
    merge: tuple[jax.Array, jax.Array, int] | None = None,
    gate: Gate | None = None,
    row_major: bool = False,
    row0: bool = False,
    interpret: bool = False,
    detect_races: bool = False,
) -> jax.Array:  # [splits, N (+ N2), Mp] f32 partials of y^T (columns >= M zero); row_major: [splits, 64, N]
    """`merge` = (o, lse, M): x is split-KV attention's output, formed here (`merge_supported`:
    each CTA merges the heads of its K range from the [8, H, S, 64] partials and their [8, H, S]
    log2-sum-exp2, rows >= M zero, into SMEM tiles that stay resident) instead of read from HBM:
    the merge and the pad to 8 rows need no launch of their own. `gate` (`Gate`): where its element
    is 0 the CTAs stream nothing and the partials are zero. `row_major` (Mp = 64 only): the
    partials of y itself, [splits, 64, N], from the unswapped product (x tile as wgmma's A): their
    sum needs no transpose, which XLA would otherwise carry into the consumers' layout (the
    forty-third session's MD2 decode step: its residual stream, then the LayerNorm reading it
    strided).

    `row0` (one row of x: M = 1, or `merge` of one row): the partials of that row
    alone, [splits, N] f32, contiguous (each CTA sums its accumulator over the 8 columns, 7 of them
    the exact zeros of the padding rows): what a consumer that finishes the row itself reads
    (`gemv_rows`' `residual`), 32 bytes of every 256 of the padded layout."""
    if merge is not None:
        o, lse, M = merge
        if x is not None or w2 is not None or gate is not None or not merge_supported(o, lse, w) or not 1 <= M <= 8:
            raise ValueError(f"merged-input gemv does not support o {o.shape} {o.dtype}, lse {lse.shape}, "
                             f"w {w.shape} {w.dtype}, rows {M} (nor x, a second product or a gate beside it)")
        K, mp, n_splits = w.shape[0], 8, o.shape[2]
        x_dtype = jnp.dtype(jnp.bfloat16)
    else:
        assert x is not None
        for ww in (w,) if w2 is None else (w, w2):
            if not gemv_supported(x, ww):
                raise ValueError(f"gemv kernel does not support x {x.shape} {x.dtype}, w {ww.shape} {ww.dtype}")
        M, K = x.shape
        mp = -(-M // 8) * 8
        if mp != M:
            x = jnp.pad(x, ((0, mp - M), (0, 0)))
        x_dtype = x.dtype
    if row_major and (mp != 64 or merge is not None):
        raise ValueError(f"row-major partials need 64 rows of x (not merged), got {mp}")
    if row0 and (M != 1 or row_major):
        raise ValueError(f"row-0 partials need one row of x (not row-major), got {M}")
    N1 = w.shape[1]
    N = N1 + (0 if w2 is None else w2.shape[1])
    s_count = splits or default_splits(K, N)
    steps_total = K // BLOCK_K
    if s_count < 1 or steps_total % s_count:
        raise ValueError(f"splits must divide the {steps_total} K steps of {BLOCK_K}, got {s_count}")
    steps = steps_total // s_count
    n_stages = max(1, min(stages, steps))
    resident = merge is not None  # x tiles formed in the kernel, every step's

    def body(*refs):
        if merge is not None:
            part_ref, lse_ref, w_ref, *rest = refs
        else:
            x_ref, w_ref, *rest = refs
        w2_ref = rest.pop(0) if w2 is not None else None
        gate_ref = rest.pop(0) if gate is not None else None
        o_ref, w_buf, x_buf, o_smem, bars = rest
        nb = lax.axis_index("n")
        s = lax.axis_index("s")
        k0 = s * (steps * BLOCK_K)
        n0 = pl.multiple_of(nb * BLOCK_N, BLOCK_N)

        def fetch(i, slot):
            k = pl.multiple_of(k0 + i * BLOCK_K, BLOCK_K)
            rows = pl.ds(k, BLOCK_K)
            if w2_ref is None:
                plgpu.copy_gmem_to_smem(w_ref.at[rows, pl.ds(n0, BLOCK_N)], w_buf.at[slot], bars.at[slot])
            else:  # column blocks past the first matrix read the second (same bytes either way)
                pl.when(n0 < N1)(lambda: plgpu.copy_gmem_to_smem(
                    w_ref.at[rows, pl.ds(jnp.minimum(n0, N1 - BLOCK_N), BLOCK_N)], w_buf.at[slot], bars.at[slot]))
                pl.when(n0 >= N1)(lambda: plgpu.copy_gmem_to_smem(
                    w2_ref.at[rows, pl.ds(jnp.maximum(n0 - N1, 0), BLOCK_N)], w_buf.at[slot], bars.at[slot]))
            if not resident:
                plgpu.copy_gmem_to_smem(x_ref.at[:, rows], x_buf.at[slot], bars.at[slot])

        def scope(acc_ref):
            if merge is not None:  # the weight ring fills while the heads of this K range merge
                _fill(fetch, n_stages)
                for i in range(steps):
                    x_buf.at[i][...] = _merged_tile(part_ref, lse_ref, lax.div(k0, BLOCK_K) + i, M, n_splits)
                plgpu.commit_smem()
                _stream(acc_ref, w_buf, x_buf, bars, fetch, steps, n_stages, resident=True)
            elif gate_ref is None:
                _stream(acc_ref, w_buf, x_buf, bars, fetch, steps, n_stages, row_major=row_major)
            else:  # gated off: the accumulator stays zero
                assert gate is not None
                pl.when(gate_ref[gate.row, gate.column] != 0)(
                    lambda: _stream(acc_ref, w_buf, x_buf, bars, fetch, steps, n_stages, row_major=row_major))
            if row0:  # row 0 of y^T's block: the padding rows' columns are exact zeros
                o_smem[...] = jnp.sum(acc_ref[...], axis=1)
            else:
                o_smem[...] = acc_ref[...]

        pl.run_scoped(scope, plgpu.ACC(acc_shape, jnp.float32))
        plgpu.commit_smem()
        if row0:
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[s, pl.ds(n0, BLOCK_N)])
        elif row_major:
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[s, :, pl.ds(n0, BLOCK_N)])
        else:
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[s, pl.ds(n0, BLOCK_N)])
        plgpu.wait_smem_to_gmem(0)

    acc_shape = (mp, BLOCK_N) if row_major else (BLOCK_N, mp)
    kern = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((s_count, N) if row0 else (s_count, mp, N) if row_major else (s_count, N, mp),
                                      jnp.float32),
        grid=(N // BLOCK_N, s_count),
        grid_names=("n", "s"),
        kernel_name="kestrel_gemv",
        scratch_types=[
            plgpu.SMEM((n_stages, BLOCK_K, BLOCK_N), w.dtype, transforms=_TRANSFORMS),
            # x tiles: the ring's, or with `merge` every step's (resident)
            plgpu.SMEM((steps if resident else n_stages, mp, BLOCK_K), x_dtype, transforms=_TRANSFORMS),
            plgpu.SMEM((BLOCK_N,) if row0 else acc_shape, jnp.float32),
            plgpu.Barrier(num_arrivals=1 if resident else 2, num_barriers=n_stages),
        ],
        interpret=_interpret_params(interpret, detect_races),
    )
    if merge is not None:
        return kern(merge[0], merge[1], w)
    return kern(x, w, *([] if w2 is None else [w2]), *([] if gate is None else [gate.table]))


# `gemv_rows`: weight-tile ring depth (9 KB per slot at 8 rows: 64 x 64 bf16 weights + the x tile).
# H100, seventeenth session, an MoE layer's QKV + router product ([2048, 6208], 24 cold weights,
# 1 row): 8 stages 10.86 us, 16 stages 11.99, 24 stages 12.25 (`gemv` with its split sum: 11.51).
ROWS_STAGES = 8
# ... and with the LayerNorm inside (one row: `ln`; the decode step's default, `ops.rows_gemv_stages`).
# H100, fifty-sixth session, 16 cold weights (`tools/bench_rows_kernel.py`): MD2's joined [2048,
# 14336] product with the LayerNorm and residual, 6 stages 22.84 / 22.91 us, 8 stages 23.89 / 23.68,
# 12 stages 25.50 / 25.43; MD2 W1 with the bias loaded early 4 stages 764.9 tok/s, 5 stages 799.4,
# 6 stages 792.4 / 790.9 (8 stages with the late bias, the defaults before: 774.3 / 765.2 / 776.4);
# MD3 W1 (early bias) 6 stages 813.7 against 8 stages 815.1 / 811.5. Fifty-eighth session (another
# H100): the same MD2 product 5 stages 21.84 / 21.83 us, 6 stages 22.29 / 22.18, 8 stages 22.93 /
# 22.89; MD2 W1 5 stages 802.9 / 804.5 against 6 stages 798.6 / 800.4 (alternating runs), MD3 W1
# (the MoE kernel's ring at 8) 828.5 against 825.7.
ROWS_STAGES_LN = 5
# ... but 8 for an MoE layer's QKV + router kernel with the LayerNorm (97 CTAs on 132 SMs: one each, so
# a deeper ring costs no residency). H100, fifty-seventh session, with the previous MoE layer's residual
# and expert rows inside as the decode step runs it (`tools/bench_rows_kernel.py` md3_res, 16 cold
# weights): 6 stages 13.58 / 13.47 us, 8 stages 13.12 / 13.15, 12 stages 13.96 / 13.99, 16 stages
# 14.78 / 14.85; MD3 W1 not distinguishable (8 stages 819.6 tok/s, 6 stages 817.5-821.6 in five runs).
ROWS_STAGES_MOE_LN = 8
_OUT_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(_SWIZZLE))  # type: ignore[abstract]


def gemv_rows(
    x: jax.Array,  # [M, K] bf16, M <= 64
    w1: jax.Array,  # [K, N1] bf16
    b1: jax.Array | None,  # [N1] bf16
    w2: jax.Array | None = None,  # [K, N2] bf16: a second product of the same x, same launch
    b2: jax.Array | None = None,  # [N2] bf16
    *,
    tau_w: tuple[jax.Array, jax.Array] | None = None,  # (wq, wv) [H, N1] bf16, 2 H = 64: MD3's tau dots
    ln: tuple[jax.Array, jax.Array] | None = None,  # (scale, bias) [K] bf16: x is the LayerNorm's input
    ln_eps: float = 1e-5,
    ln_tiles_ahead: bool = False,
    # (parts [S, K] f32, bias [K] bf16 or None[, (y, dest, weights, n_valid): an MoE layer's `ExpertRows`])
    residual: tuple[Any, ...] | None = None,
    stages: int = ROWS_STAGES,
    bias_early: bool = True,
    interpret: bool = False,
    detect_races: bool = False,
) -> tuple[jax.Array, ...]:  # ([Mp, N1] bf16,) or ([Mp, N1], [Mp, N2]); rows >= M are x's padding rows' products
    """x @ w + b as finished bf16 rows, no split sum: one CTA per 64 output columns streams the
    whole reduction and its epilogue adds the bias and writes rows [Mp, 64] (Mp = M rounded up to 8,
    as the decode GEMM's and the MoE block's row tile). The rounding is `gemv`'s: the f32 product
    rounded to bf16, the bias added in bf16. For consumers that are kernels (the decode QKV
    epilogue, the routing tables): XLA cannot fuse `gemv`'s split sum into them, so it ran as two
    launches of its own per layer. `bias_early` (default): each CTA loads its 64 bias values before
    its K loop, not after it, where the load's latency sat in every CTA's tail (H100, fifty-sixth
    session, 16 cold weights: MD2's joined product with the LayerNorm and residual 23.89 / 23.68 ->
    23.26 / 23.36 us, MD3's QKV + router with the LayerNorm and tau dots 12.30 / 12.30 -> 11.95 /
    12.01; the same rows bit for bit).

    With `tau_w` (MD3's tau weights over the QKV row, `qkv_epilogue.TauWeights.wq` / `.wv`), each
    CTA of the first product also forms its columns' share of the tau dot products: g =
    GELU(u) of its finished bf16 block (`gelu_erf_poly`, rounded to bf16) times the [2 H, 64] tile
    of [wq; wv] (one more wgmma), f32. Appended output: dots [N1 / 64, 2 H, Mp] f32, whose sum
    over the first axis is g . wq[h] (rows h < H) and g . wv[h - H] (`tau_dots_ref`). The QKV
    epilogue then reads 2 x N1 / 64 floats per head instead of the whole row and both weight rows
    (`qkv_epilogue`'s dots mode).

    With `ln` = (scale, bias) x is the LayerNorm's input (eps `ln_eps`; the residual stream, one
    row, `ln_rows_problem`) and every CTA normalises it itself (`ln_rows_ref`'s numerics: float32
    statistics E[x], E[x^2] in one pass, rounded to bf16; rows >= 1 zero) into one SMEM row while
    its weight ring fills (x, scale and bias loaded before the fill is issued): the LayerNorm needs
    no launch of its own. Each step of the K loop forms its x tile from that row before it waits for
    its weight tile (the stream leaves each step idle for that long at one row), so only the loads
    and the statistics lie between the first weight tile and the first MMA; `ln_tiles_ahead` forms
    every tile before the first MMA instead (the forty-ninth session's order, measured +2.5 us on
    the kernel, for A/B runs). The normalised rows, padded to Mp, are appended to the outputs (after
    the tau dots), written tile by tile by CTA 0, for the other readers of the layer's normalised
    input (the MoE's expert GEMMs).

    With `residual` = (parts, bias) as well, x is the residual stream before the previous layer's
    output is added: the LayerNorm's input is x' = x + (the sum of parts [S, K] over S, rounded to
    bf16, + bias, rounded to bf16), rounded to bf16 (`residual_row_ref`: the split partials of the
    previous layer's one-row output product, `gemv_partials(row0=True)`, summed in their order,
    finished and added to the stream as XLA rounds `x + gemv(...)`). Every CTA forms x' from the
    loads issued before its weight ring's fill; CTA 0 writes it out, [1, K] bf16, appended after
    the normalised rows: the residual add needs no launch of its own. With a third item, an MoE
    layer's unreduced output (y [R, K] bf16 expert rows, dest [k, P] int32, weights [k, P] f32,
    n_valid [1] int32: `decode_residual.ExpertRows`), x' = (x + that) + m, m = sum_j weights[j, 0]
    y[dest[j, 0]] in f32 over j in order (0 where n_valid is 0), rounded to bf16, each add rounded
    to bf16 (`residual_row_ref`): the parallel block's residual of an MoE layer whose projection
    the down GEMM streamed (its row-0 partials, `moe_mgpu.SideProduct.row0`)."""
    ws = (w1,) if w2 is None else (w1, w2)
    bs = (b1,) if w2 is None else (b1, b2)
    for ww, bb in zip(ws, bs, strict=True):
        if not gemv_supported(x, ww):
            raise ValueError(f"gemv kernel does not support x {x.shape} {x.dtype}, w {ww.shape} {ww.dtype}")
        if bb is not None and (bb.shape != (ww.shape[1],) or jnp.dtype(bb.dtype) != jnp.dtype(jnp.bfloat16)):
            raise ValueError(f"bias {bb.shape} {bb.dtype} does not fit w {ww.shape}: need bf16 [{ww.shape[1]}]")
    M, K = x.shape
    N1 = w1.shape[1]
    problem = None if tau_w is None else tau_dots_problem(tau_w[0], tau_w[1], N1)
    if problem is None and ln is not None:
        problem = ln_rows_problem(x, ln[0], ln[1])
    if problem is None and residual is not None:
        problem = residual_problem(x, *residual) if ln is not None else "a residual without `ln`"
    if problem is not None:
        raise ValueError(f"gemv_rows: {problem}")
    mp = -(-M // 8) * 8
    if mp != M and ln is None:
        x = jnp.pad(x, ((0, mp - M), (0, 0)))
    steps = K // BLOCK_K
    has_ln = ln is not None
    has_res = residual is not None
    res_bias = has_res and residual is not None and residual[1] is not None
    n_parts = 0 if residual is None else residual[0].shape[0]
    expert = None if residual is None or len(residual) < 3 else residual[2]
    top_k = 0 if expert is None else expert[1].shape[0]
    # with `ln` the x tiles are formed in the kernel and stay resident: the ring carries weights only
    per_stage = (BLOCK_K * BLOCK_N + (0 if has_ln else mp * BLOCK_K)) * 2
    tau_smem = 0 if tau_w is None else TAU_ROWS * BLOCK_N * 2 + mp * BLOCK_N * 2 + TAU_ROWS * mp * 4 + 64
    ln_smem = 0 if not has_ln else (steps * mp * BLOCK_K + K * (2 if has_res else 1)) * 2
    n_stages = max(1, min(stages, steps, (_SMEM_LIMIT - mp * BLOCK_N * 2 - 2048 - tau_smem - ln_smem) // per_stage))
    n_blocks = sum(ww.shape[1] for ww in ws) // BLOCK_N
    w_refs_n, b_present = len(ws), [bb is not None for bb in bs]
    has_tau = tau_w is not None
    h_tau = TAU_ROWS // 2

    def body(x_ref, *refs):
        w_refs = refs[:w_refs_n]
        rest = list(refs[w_refs_n:])
        b_refs = [rest.pop(0) if present else None for present in b_present]
        wq_ref, wv_ref = (rest.pop(0), rest.pop(0)) if has_tau else (None, None)
        sc_ref, sh_ref = (rest.pop(0), rest.pop(0)) if has_ln else (None, None)
        p_ref = rest.pop(0) if has_res else None
        rb_ref = rest.pop(0) if res_bias else None
        ey_ref, ed_ref, ew_ref, ev_ref = [rest.pop(0) for _ in range(4)] if expert is not None else [None] * 4
        o_refs = [rest.pop(0) for _ in ws]
        d_ref = rest.pop(0) if has_tau else None
        n_ref = rest.pop(0) if has_ln else None
        r_ref = rest.pop(0) if has_res else None
        w_buf, x_buf, o_smem, bars = rest[:4]
        rest = rest[4:]
        n_row = rest.pop(0) if has_ln else None
        r_row = rest.pop(0) if has_res else None
        nb = lax.axis_index("n")
        n0 = pl.multiple_of(nb * BLOCK_N, BLOCK_N)
        if has_tau:
            t_smem, g_smem, d_smem, t_bar = rest
            assert wq_ref is not None and wv_ref is not None

            @pl.when(n0 < N1)
            def _tau_tile():  # [wq; wv] columns of this block, in flight beside the ring
                cols = pl.ds(jnp.minimum(n0, N1 - BLOCK_N), BLOCK_N)
                plgpu.copy_gmem_to_smem(wq_ref.at[:, cols], t_smem.at[pl.ds(0, h_tau)], t_bar.at[0])
                plgpu.copy_gmem_to_smem(wv_ref.at[:, cols], t_smem.at[pl.ds(h_tau, h_tau)], t_bar.at[0])

        def matrix_col(i):  # this block's column offset inside matrix i (clamped into it)
            lo = 0 if i == 0 else N1
            return pl.multiple_of(jnp.minimum(jnp.maximum(n0 - lo, 0), ws[i].shape[1] - BLOCK_N), BLOCK_N)

        def on_matrix(i, fn):  # run fn(column offset inside matrix i) in the CTAs whose block is in it
            lo = 0 if i == 0 else N1
            hi = N1 if (i == 0 and w_refs_n == 2) else lo + ws[i].shape[1]
            col = matrix_col(i)
            pl.when((n0 >= lo) & (n0 < hi))(lambda: fn(col))

        def load_bias(m, col):  # this block's 64 bias values of matrix m, in the accumulator's row layout
            b_ref = b_refs[m]
            assert b_ref is not None
            return plgpu.load(b_ref.at[pl.ds(col, BLOCK_N)], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)

        # `bias_early`: the bias slices loaded before the stream (each CTA's load of every matrix at
        # its clamped column: in flight during the K loop, not a dependent load after it)
        early = [load_bias(m, matrix_col(m)) if bias_early and b_refs[m] is not None else None
                 for m in range(w_refs_n)]

        def fetch(i, slot):
            rows = pl.ds(pl.multiple_of(i * BLOCK_K, BLOCK_K), BLOCK_K)
            for m in range(w_refs_n):
                on_matrix(m, lambda col, m=m: plgpu.copy_gmem_to_smem(
                    w_refs[m].at[rows, pl.ds(col, BLOCK_N)], w_buf.at[slot], bars.at[slot]))
            if not has_ln:
                plgpu.copy_gmem_to_smem(x_ref.at[:, rows], x_buf.at[slot], bars.at[slot])

        def ln_loads():
            """x, scale and bias as whole rows from GMEM in 16-byte vectors (8-byte ones for bf16
            beside a residual's f32 partials, `_ln_vec`; the row is 2 per thread at D = 2048),
            issued before the weight ring's fill so that they do not queue behind its
            ~6 MB of tile loads (fifty-second session, H100: with the loads after the fill, and scale
            and bias only after the statistics, the kernel took 12.8 us against 11.4 without the
            LayerNorm). Session 49 on an H100: reading the operands as 64-column slices instead cost
            12 us per call (128 dependent 4-byte loads per thread), and through a TMA copy the SMEM
            got a swizzle the plain loads did not undo."""
            assert sc_ref is not None and sh_ref is not None
            strided = plgpu.Layout.WG_STRIDED((K,), _ln_vec(K, has_res))
            refs = [x_ref.at[0], sc_ref, sh_ref]
            if p_ref is not None:  # the residual's partials (and bias) too
                refs += [p_ref.at[i] for i in range(n_parts)] + ([] if rb_ref is None else [rb_ref])
            if ey_ref is not None:  # and the token's expert rows (their indices read first)
                assert ed_ref is not None
                refs += [ey_ref.at[ed_ref[j, 0]] for j in range(top_k)]
            return tuple(plgpu.load(ref, layout=strided) for ref in refs)

        def normalise(loaded):
            """x's row normalised into the SMEM row `n_row`, from which `ln_tile` forms the x tiles:
            the statistics reduced over the warpgroup, the normalised row stored to SMEM (then read
            back in 64-column slices, in the layout that stores into the swizzled operand tiles,
            `_XROWS`)."""
            assert n_ref is not None and n_row is not None
            xv, sc, sh = (v.astype(jnp.float32) for v in loaded[:3])
            if has_res:  # x' = x + finished(sum of the partials in order, + bias), as XLA rounds it
                assert r_row is not None and r_ref is not None
                parts = loaded[3:3 + n_parts]
                y = functools.reduce(jnp.add, parts).astype(jnp.bfloat16).astype(jnp.float32)
                if res_bias:
                    y = (y + loaded[3 + n_parts].astype(jnp.float32)).astype(jnp.bfloat16).astype(jnp.float32)
                xn = (xv + y).astype(jnp.bfloat16)
                if expert is not None:  # + the weighted sum of the token's expert rows
                    assert ew_ref is not None and ev_ref is not None
                    rows = loaded[3 + n_parts + int(res_bias):]
                    m = functools.reduce(jnp.add, [ew_ref[j, 0] * r.astype(jnp.float32) for j, r in enumerate(rows)])
                    valid = lax.broadcast_in_dim(ev_ref[0] > 0, (K,), ())  # (rows of an empty step: never read)
                    m = jnp.where(valid, m, jnp.zeros_like(m)).astype(jnp.bfloat16)
                    xn = (xn.astype(jnp.float32) + m.astype(jnp.float32)).astype(jnp.bfloat16)
                r_row[...] = xn
                xv = xn.astype(jnp.float32)
            mean = jnp.sum(xv) / K
            var = jnp.maximum(jnp.sum(xv * xv) / K - mean * mean, 0.0)
            n = (xv - mean) * lax.rsqrt(var + ln_eps) * sc + sh
            n_row[...] = n.astype(jnp.bfloat16)
            plgpu.commit_smem()
            if has_res:

                @pl.when(nb == 0)
                def _write_residual():  # in slices of at most 256 elements (a TMA box's limit)
                    assert r_row is not None and r_ref is not None
                    for c in range(0, K, _BOX):
                        plgpu.copy_smem_to_gmem(r_row.at[pl.ds(c, min(_BOX, K - c))],
                                                r_ref.at[0, pl.ds(c, min(_BOX, K - c))])

        def ln_tile(i, commit: bool = True):
            """Step i's x tile from the normalised row (row 0; the padding rows zero); CTA 0 also
            writes it out (the normalised rows the expert GEMMs read)."""
            assert n_row is not None and n_ref is not None
            cols = pl.ds(i * BLOCK_K if isinstance(i, int) else pl.multiple_of(i * BLOCK_K, BLOCK_K), BLOCK_K)
            _row_tile(n_row, x_buf.at[i], cols, mp)
            if commit:
                plgpu.commit_smem()
                pl.when(nb == 0)(lambda: plgpu.copy_smem_to_gmem(x_buf.at[i], n_ref.at[:, cols]))

        def scope(acc_ref):
            if has_ln:  # the weight ring fills while the rows are normalised
                loaded = ln_loads()
                _fill(fetch, n_stages)
                normalise(loaded)
                if ln_tiles_ahead:  # every tile before the first MMA (the forty-ninth session's order)
                    for i in range(steps):
                        ln_tile(i, commit=False)
                    plgpu.commit_smem()

                    @pl.when(nb == 0)
                    def _write():
                        assert n_ref is not None
                        for i in range(steps):
                            plgpu.copy_smem_to_gmem(x_buf.at[i], n_ref.at[:, pl.ds(i * BLOCK_K, BLOCK_K)])

                _stream(acc_ref, w_buf, x_buf, bars, fetch, steps, n_stages, resident=True,
                        prepare=None if ln_tiles_ahead else ln_tile)
            else:
                _stream(acc_ref, w_buf, x_buf, bars, fetch, steps, n_stages)
            y = acc_ref[...].astype(jnp.bfloat16)

            for m in range(w_refs_n):
                def store(col, m=m):
                    r = y
                    if b_refs[m] is not None:
                        bias = early[m] if early[m] is not None else load_bias(m, col)
                        r = (y.astype(jnp.float32) + lax.broadcast_in_dim(
                            bias.astype(jnp.float32), (BLOCK_N, mp), [0])).astype(jnp.bfloat16)
                    o_smem.T[...] = r
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(o_smem, o_refs[m].at[:, pl.ds(col, BLOCK_N)])
                    if m == 0 and has_tau:
                        tau_block(r, col)
                on_matrix(m, store)

        def tau_block(r, col):
            """dots[block] = [wq; wv][:, block] @ GELU(u block) (bf16 operands, f32 product)."""
            g_smem.T[...] = gelu_erf_poly(r.astype(jnp.float32)).astype(jnp.bfloat16)
            plgpu.commit_smem()
            plgpu.barrier_wait(t_bar.at[0])

            def dots(acc_ref):
                plgpu.wgmma(acc_ref, t_smem, g_smem.T)
                plgpu.wgmma_wait(0)
                d_smem[...] = acc_ref[...]

            pl.run_scoped(dots, plgpu.ACC((TAU_ROWS, mp), jnp.float32))
            plgpu.commit_smem()
            assert d_ref is not None
            plgpu.copy_smem_to_gmem(d_smem, d_ref.at[col // BLOCK_N])

        pl.run_scoped(scope, plgpu.ACC((BLOCK_N, mp), jnp.float32))
        plgpu.wait_smem_to_gmem(0)

    out_type = [jax.ShapeDtypeStruct((mp, ww.shape[1]), jnp.bfloat16) for ww in ws]
    scratch: list[Any] = [
        plgpu.SMEM((n_stages, BLOCK_K, BLOCK_N), x.dtype, transforms=_TRANSFORMS),
        # x tiles: the ring's, or with `ln` every step's (formed in the kernel, resident)
        plgpu.SMEM((steps if has_ln else n_stages, mp, BLOCK_K), x.dtype, transforms=_TRANSFORMS),
        plgpu.SMEM((mp, BLOCK_N), jnp.bfloat16, transforms=_OUT_TRANSFORMS),
        plgpu.Barrier(num_arrivals=1 if has_ln else 2, num_barriers=n_stages),
    ]
    if has_ln:
        scratch.append(plgpu.SMEM((K,), jnp.bfloat16))  # the normalised row, on its way into the tiles
    if has_res:
        scratch.append(plgpu.SMEM((K,), jnp.bfloat16))  # the residual stream's new row, on its way out
    if has_tau:
        out_type.append(jax.ShapeDtypeStruct((N1 // BLOCK_N, TAU_ROWS, mp), jnp.float32))
        scratch += [
            plgpu.SMEM((TAU_ROWS, BLOCK_N), x.dtype, transforms=_TRANSFORMS),  # [wq; wv] tile: the wgmma A
            plgpu.SMEM((mp, BLOCK_N), jnp.bfloat16, transforms=_TRANSFORMS),  # GELU(u) block: the wgmma B
            plgpu.SMEM((TAU_ROWS, mp), jnp.float32),
            plgpu.Barrier(num_arrivals=2, num_barriers=1),
        ]
    if has_ln:
        out_type.append(jax.ShapeDtypeStruct((mp, K), jnp.bfloat16))
    if has_res:
        out_type.append(jax.ShapeDtypeStruct((1, K), jnp.bfloat16))
    kern = plgpu.kernel(
        body,
        out_type=tuple(out_type),
        grid=(n_blocks,),
        grid_names=("n",),
        kernel_name="kestrel_gemv_rows",
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=_interpret_params(interpret, detect_races),
    )
    args = [x, *ws, *[bb for bb in bs if bb is not None], *(tau_w or ())]
    if has_ln:
        assert ln is not None
        args += [ln[0], ln[1]]
    if residual is not None:
        args += [residual[0], *([] if residual[1] is None else [residual[1]]), *(expert or ())]
    return tuple(kern(*args))


LN_VEC = 8  # elements per thread per load of the LayerNorm's operands (16 bytes of bf16)


_BOX = 256  # elements along a dimension of one TMA copy, at most


def _ln_vec(k: int, f32: bool = False) -> int:
    """Elements per load of a [k] row over a warpgroup (k a multiple of 128): up to `LN_VEC`, or
    with `f32` operands among the row's loads (`gemv_rows`' residual partials) up to 4 (16 bytes)."""
    v = LN_VEC // 2 if f32 else LN_VEC
    while (k // 128) % v:
        v //= 2
    return v


def ln_rows_problem(x: jax.Array | jax.ShapeDtypeStruct, scale: jax.Array | jax.ShapeDtypeStruct,
                    bias: jax.Array | jax.ShapeDtypeStruct) -> str | None:
    """Why `gemv_rows` cannot normalise x itself with this scale and bias (None: it can)."""
    M, K = x.shape
    if M != 1:
        return f"the LayerNorm in the rows kernel takes one row, got {M}"
    if K % 128:
        return f"the LayerNorm in the rows kernel takes widths that are multiples of 128, got {K}"
    if scale.shape != (K,) or bias.shape != (K,):
        return f"LayerNorm scale {scale.shape} / bias {bias.shape} must be [{K}]"
    if any(jnp.dtype(a.dtype) != jnp.dtype(jnp.bfloat16) for a in (x, scale, bias)):
        return (f"the LayerNorm in the rows kernel takes bf16 x, scale and bias, got {x.dtype}, {scale.dtype}, "
                f"{bias.dtype}")
    return None


def residual_problem(x: jax.Array | jax.ShapeDtypeStruct, parts: jax.Array | jax.ShapeDtypeStruct,
                     bias: jax.Array | jax.ShapeDtypeStruct | None,
                     expert: tuple[Any, ...] | None = None) -> str | None:
    """Why `gemv_rows` cannot add this residual (parts [S, K] f32, bias [K] bf16 or None, expert
    rows (y [R, K] bf16, dest [k, P] int32, weights [k, P] f32, n_valid [1] int32) or None) to x
    itself (None: it can)."""
    K = x.shape[1]
    if expert is not None:
        y, dest, w, nv = expert
        if (y.ndim != 2 or y.shape[1] != K or jnp.dtype(y.dtype) != jnp.dtype(jnp.bfloat16) or dest.ndim != 2
                or not 1 <= dest.shape[0] <= 16 or w.shape != dest.shape or nv.shape != (1,)
                or jnp.dtype(dest.dtype) != jnp.dtype(jnp.int32) or jnp.dtype(w.dtype) != jnp.dtype(jnp.float32)
                or jnp.dtype(nv.dtype) != jnp.dtype(jnp.int32)):
            return (f"expert rows y {y.shape} {y.dtype}, dest {dest.shape} {dest.dtype}, weights {w.shape} {w.dtype}, "
                    f"n_valid {nv.shape} {nv.dtype} must be bf16 [R, {K}], int32 [1..16, P], f32 [k, P], int32 [1]")
    if parts.ndim != 2 or parts.shape[1] != K or not 1 <= parts.shape[0] <= 16:
        return f"residual partials {parts.shape} must be [1..16, {K}]"
    if jnp.dtype(parts.dtype) != jnp.dtype(jnp.float32):
        return f"residual partials must be float32, got {parts.dtype}"
    if bias is not None and (bias.shape != (K,) or jnp.dtype(bias.dtype) != jnp.dtype(jnp.bfloat16)):
        return f"residual bias {bias.shape} {bias.dtype} must be bf16 [{K}]"
    return None


def residual_row_ref(x: jax.Array, parts: jax.Array, bias: jax.Array | None,
                     expert: tuple[Any, ...] | None = None) -> jax.Array:
    """x' of `gemv_rows`' residual: x [1, K] bf16 + (parts [S, K] f32 summed in order, rounded to
    bf16, + bias in bf16), in bf16: what `x + gemv(row, w, bias)` gives at one row; with `expert`
    (y, dest, weights, n_valid) that plus the weighted sum of token 0's expert rows (f32, rounded
    to bf16; `decode_residual.combine_rows`, whose sum's order XLA picks), in bf16."""
    y = functools.reduce(jnp.add, [parts[i] for i in range(parts.shape[0])])[None]
    out = x + _finish(y, bias, jnp.dtype(x.dtype))
    if expert is None:
        return out
    from kestrel_jax.pallas.decode_residual import ExpertRows, combine_rows

    return out + combine_rows(ExpertRows(*expert), 1, x.dtype)


def ln_rows_ref(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """The normalised rows `gemv_rows(ln=...)` forms and appends: `layers.layer_norm` of x, rows
    padded with zeros to the row tile of 8."""
    from kestrel_jax.models.layers import layer_norm

    return jnp.pad(layer_norm(x, scale, bias, eps), ((0, -(-x.shape[0] // 8) * 8 - x.shape[0]), (0, 0)))


TAU_ROWS = 64  # rows of [wq; wv]: MD3's 2 x 32 heads, one wgmma M


def tau_dots_problem(wq: jax.Array, wv: jax.Array, n1: int) -> str | None:
    """Why `gemv_rows` cannot form tau dots with these weights for a first product of n1 columns."""
    if wq.shape != (TAU_ROWS // 2, n1) or wv.shape != wq.shape:
        return f"tau weights {wq.shape} / {wv.shape} must be [{TAU_ROWS // 2}, {n1}] (2 x heads = one wgmma M)"
    if any(jnp.dtype(w.dtype) != jnp.dtype(jnp.bfloat16) for w in (wq, wv)):
        return f"tau weights must be bf16, got {wq.dtype} / {wv.dtype}"
    return None


def tau_dots_ref(u: jax.Array, wq: jax.Array, wv: jax.Array) -> jax.Array:
    """The tau dot products `gemv_rows(tau_w=...)`'s blocks sum to: [2 H, rows] f32 of
    g . [wq; wv] with g = GELU(u) rounded to bf16 (`gelu_erf_poly`), for u [rows, N1] bf16."""
    g = gelu_erf_poly(u.astype(jnp.float32)).astype(jnp.bfloat16).astype(jnp.float32)
    w = jnp.concatenate([wq, wv]).astype(jnp.float32)
    return jnp.dot(w, g.T, precision=lax.Precision.HIGHEST)


def _summed(parts: jax.Array, rows: int, row_major: bool = False) -> jax.Array:
    """[splits, N, Mp] partials (`row_major`: [splits, Mp, N]) -> [rows, N] f32: an unrolled
    elementwise sum (XLA fuses it, the transpose, the bias add and the cast into whatever consumes
    the product)."""
    y = functools.reduce(jnp.add, [parts[i] for i in range(parts.shape[0])])
    return (y if row_major else y.T)[:rows]


def _finish(y: jax.Array, bias: jax.Array | None, dtype: jnp.dtype) -> jax.Array:
    y = y.astype(dtype)
    return y if bias is None else y + bias.astype(dtype)  # bf16 add, as the jnp path rounds it


def gemv_pair(x: jax.Array, w1: jax.Array, b1: jax.Array | None, w2: jax.Array, b2: jax.Array | None, *,
              splits: int | None = None, interpret: bool = False, rows: int | None = None,
              gate: Gate | None = None) -> tuple[jax.Array, jax.Array]:
    """(x @ w1 + b1, x @ w2 + b2) from one launch: two products of the same rows (an MoE layer's
    QKV and router, which read the same LayerNorm output). `rows`: the real rows of x when x
    arrives padded (products of the first `rows` only). `gate`: `gemv_partials`'."""
    y = _summed(gemv_partials(x, w1, w2, splits=splits, gate=gate, interpret=interpret),
                rows or x.shape[0])
    n1 = w1.shape[1]
    return _finish(y[:, :n1], b1, x.dtype), _finish(y[:, n1:], b2, x.dtype)


def gemv_merged(o: jax.Array, lse: jax.Array, w: jax.Array, bias: jax.Array | None = None, *, rows: int,
                interpret: bool = False) -> jax.Array:
    """merge_splits(o, lse)[:rows] (split-KV attention partials, `merge_supported`) @ w (+ bias) in
    bf16, the merge done inside the GEMM's launch (`gemv_partials`' merge)."""
    return _finish(_summed(gemv_partials(None, w, merge=(o, lse, rows), interpret=interpret), rows), bias,
                   jnp.dtype(jnp.bfloat16))


def gemv(x: jax.Array, w: jax.Array, bias: jax.Array | None = None, *, splits: int | None = None,
         stages: int = 4, row_major: bool = False, interpret: bool = False, rows: int | None = None,
         gate: Gate | None = None) -> jax.Array:
    """x [M, K] @ w [K, N] (+ bias) in x.dtype, f32 accumulation; the first `rows` rows (default M).
    `gate`: `gemv_partials`' (closed: just the bias). `stages`: the TMA ring's slots per CTA.
    `row_major` (M = 64): `gemv_partials`' row-major partials."""
    parts = gemv_partials(x, w, splits=splits, stages=stages, gate=gate, row_major=row_major, interpret=interpret)
    return _finish(_summed(parts, rows or x.shape[0], row_major), bias, x.dtype)
