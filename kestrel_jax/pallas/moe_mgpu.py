"""Mixture-of-experts layer as Mosaic GPU (Hopper) grouped-GEMM kernels.

One layer (`moe_layer`, T static), two regimes chosen by `default_config(T)`:

  dense (T <= 64, decode):   router GEMM (XLA) -> ROUTE tables (`moe_route_triton`: top-k,
                             softmax, block table) -> UP -> DOWN -> combine (jnp)
  sorted (T > 64, prefill):  route_ref + group_by_expert (jnp: ranks by counting, no sort;
                             block table, compact rows) -> gather (+ FP8 quantise; rows moved
                             as 32-bit words) -> UP -> (W8A8: quantise act) -> DOWN -> combine
                             (jnp). H100, FP8, per layer: T=740 239.5 us, T=1480 319.2 us
                             (twenty-sixth session)

  UP:   act[row, I] = GELU_erf(h) * (g + 1), [h; g] = up_w[e] @ x[row]   (f32 epilogue, bf16 out)
  DOWN: y[row, D]   = down_w[e] @ act[row]                                  (bf16 out)
  combine: out[t]   = sum_k w[t, k] * y[dest[t, k]]                         (f32, one fusion)

Dense: one block per active expert holding all T tokens (Nt = round_up(T, 8) >= T), so every
active expert's weights are read exactly once and the bookkeeping needs no sort. Sorted: blocks
of Nt = 64 / 128 tokens of one expert (`moe_grouping.py`).

Both GEMMs are one kernel, `_grouped_gemm`, "swap-AB" oriented: expert weight rows are the
wgmma M side (64 rows per tile) and a block of Nt tokens is the N side (8..256), so one decode
token wastes nothing and a wide block still feeds wgmma. Weights are [E, out, in] and token
rows [rows, K]: both K-major, as FP8 wgmma requires. A work unit is (block b, 64-row output
slice j); units go round-robin to a persistent grid of `num_ctas` CTAs. Dense regime: b fastest,
so the blocks of the active experts stream side by side (a GEMM quantising its rows per block
takes contiguous ranges, j fastest, instead: see FP8 W8A8 below). Sorted regime: j fastest, so
the CTAs running at one time cover a few consecutive blocks, all slices of each: each block's
token rows come from DRAM once and an expert's blocks share its weight tiles through L2. Each CTA
runs one continuous TMA -> SMEM ring across all its units (weight streaming never drains between
units); the accumulator is re-scoped per unit; the block table is copied to SMEM once.

Side product (decode, `SideProduct`): the down GEMM's launch may also stream an unrelated small
product, the MoE layer's attention output projection at up to 8 decode rows: its (64-column block,
K range) pieces go to the CTAs from the last one down, whose dense-regime units are fewest, with
their tiles requested before the block table arrives. H200, forty-sixth session: MD3 batch-1 step
-3.9%, W1 +4.7% (`ops.proj_in_down_wanted`). Its x may be `MergedRows`, split-KV attention
partials that the up GEMM's launch merges (a head per CTA from the last one down, while their rings'
first tiles arrive) and writes for it, so the merge and the pad to 8 rows leave XLA's fusion
(`ops.merge_in_up_wanted`, on by default since the forty-eighth session: MD3 batch-1 step -1.5%).

Precisions (A = weights, B = tokens):
  bf16:        bf16 x bf16 wgmma.
  FP8 W8A8:    e4m3 x e4m3 wgmma; weight scale per (expert, row) and token scale per row applied
               in the f32 epilogue. The default. In the dense regime the GEMMs quantise their own
               bf16 rows (`quantize_b`, where they fit in SMEM: up to 24 token rows for the up
               projection and 40 for the down one at D = 2048, I = 1024): the up GEMM once per
               CTA (every block reads the same rows), the down GEMM once per block of its
               contiguous range of units, the rows loaded ahead of the weight ring. Elsewhere one
               Triton launch per operand (`quantize_triton`). H100, nineteenth session, per layer:
               T=1 33.4 vs 36.4 us with the launches, T=4 83.2 vs 87.7, T=16 145.8 vs 151.6.
  FP8 W8A16:   e4m3 weight tiles upcast to an f16 SMEM staging tile (SMEM, not registers,
               because the interpreter has no register-operand wgmma), f16 token rows and
               intermediate activation (`f16_operands`, default: e4m3 -> f16 is one instruction
               per two weights, e4m3 -> bf16 goes through f32; f16 keeps 3 more mantissa bits than
               bf16 and saturates at +-65504 instead of overflowing). H100, fifth session: T=1
               37.3 vs 37.6 us with bf16 operands, T=4 97.2 vs 99.9, T=16 165.0 vs 175.5 (the
               upcast is not what bounds the T=1 stream). 5x smaller error than W8A8, slower at
               every T since the quantisation moved into the GEMMs (T=1 35.9 vs 33.4 us);
               `MoEKernelConfig.w8a8` flips it.

Predicted H100 SXM (copy ceiling ~3.0 TB/s; streaming kernels at ~85% of it; ~2-3 us fixed cost
per kernel), CUPTI sum of kernel times per layer:
  FP8  T=1: 50.3 MB of experts (8): UP ~15 + DOWN ~9 + ROUTE ~4 + pad/combine ~3 = ~30 us (29)
       T=4: ~26.5 experts, 167 MB: ~76 us (79);  T=16: ~56 experts, 355 MB: ~150 us (146)
       T=740: 403 MB and ~120 GFLOP (block padding included) on one warpgroup per SM, about
       balanced: ~180-220 us for UP+DOWN + ~30-40 us of jnp glue = ~210-260 us (245)
  bf16 doubles the bytes: T=1 ~50, T=4 ~140, T=16 ~290, T=740 ~350-400 us.
(Kestrel's H100 FP8 figures in parentheses.)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.pallas import mosaic_gpu as plgpu

from kestrel_jax.pallas import mgpu_interpret
from kestrel_jax.pallas.decode_residual import ExpertRows, combine_rows
from kestrel_jax.pallas.gemv_mgpu import _TRANSFORMS as GEMV_TRANSFORMS
from kestrel_jax.pallas.gemv_mgpu import BLOCK_K as SIDE_BK
from kestrel_jax.pallas.gemv_mgpu import _merged_tile, merge_supported
from kestrel_jax.pallas.gemv_mgpu import _stream as gemv_stream
from kestrel_jax.pallas.moe import (
    FP8_MAX,
    ExpertWeights,
    Routing,
    gelu_erf_poly,
    quantize_rows,
    route_ref,
    router_logits,
)
from kestrel_jax.pallas.moe_grouping import ROW_ALIGN, group_by_expert, group_dense, grouping_sizes
from kestrel_jax.pallas.moe_route_mgpu import DenseRoute, route_dense, route_dense_supported
from kestrel_jax.pallas.moe_route_triton import route_tables, route_tables_supported
from kestrel_jax.pallas.paged_attention_mgpu import own_buffer
from kestrel_jax.pallas.quantize_triton import quantize_rows_kernel, quantize_rows_problem
from kestrel_jax.switches import choice, flag, integer

FP8 = jnp.float8_e4m3fn
F16_MAX = 65504.0
ROWS = 64  # weight rows per tile: the wgmma M of one warpgroup
SMEM_LIMIT = 232448  # bytes of dynamic SMEM per block on H100/H200 (what Mosaic checks)
H100_SMS = 132
# Register layout of an [8, 128] slice of 16-bit token rows for the in-GEMM quantisation: each warp
# holds two rows and reduces them along the 128 columns (a per-row max), the vector the TMA-ready
# e4m3 tile is stored from.
_QROWS = plgpu.Layout.TILED(mgpu_fa.Tiling(((8, 128), (2, 128), (4,))), warp_dims=(-5,), lane_dims=(-2,),
                            vector_dim=-1)
MIN_QUANT_STAGES = 4  # in-GEMM quantisation only where its SMEM leaves a ring this deep


SIDE_SMEM_MAX = 96 * 1024  # a side product's resident tiles (`SideProduct.smem_bytes`)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["o", "lse"], meta_fields=["rows"])
@dataclasses.dataclass(frozen=True)
class MergedRows:
    """Split-KV decode attention's partials standing in for a side product's x (`SideProduct.x`):
    the up GEMM's launch merges them (`_grouped_gemm(merge=...)`: one head at a time on the CTAs
    from the last one down, whose units are fewest, while their rings' first tiles arrive; the
    arithmetic of `gemv_mgpu._merged_tile`, rows >= `rows` zero) into the [8, H * 64] bf16 rows
    the down GEMM's side product then reads. The merge and the pad to 8 rows then take no launch
    of their own (`ops.merge_in_up_wanted`). A pytree whose `rows` is static (its aux data), so
    it passes through `jax.jit` (`ops.moe_layer_rows`) as a Python int: the kernels' plans read it."""

    o: jax.Array  # [8, H, S, 64] f32 normalised partials
    lse: jax.Array  # [8, H, S] f32 log2-sum-exp2
    rows: int  # real rows, <= 8


MERGE_ROWS = 8  # rows of the merged x: the partials' row tile (`paged_attention_mgpu`'s partial_rows)


class SideProduct(NamedTuple):
    """A decode-size product y = x @ w that an expert GEMM streams in its own launch beside its
    units (`_grouped_gemm(side=...)`): an MoE layer's attention output projection rides in the down
    GEMM at decode instead of taking a launch of its own. Its pieces, (64-column block, K range)
    pairs, go to the CTAs from the last one down; a piece holds its whole K range of weight and x
    tiles resident in SMEM (`steps` tiles of `gemv_mgpu`'s layout: [64, 64] weights, [Mp, 64] x),
    all requested before the block table, and forms its [64, Mp] block of y^T with wgmma (swap-AB,
    as `gemv_mgpu.gemv_partials`). Output: f32 partials [splits, N, Mp] of y^T, summed by the
    caller (`gemv_mgpu._summed`); with `row0` (x one real row, the others zero) row 0's alone,
    [splits, N] (`gemv_mgpu.gemv_partials`' row0: what `gemv_mgpu.gemv_rows`' residual reads)."""

    x: jax.Array | MergedRows  # [Mp, K] bf16, Mp a multiple of 8 <= 64; or partials the up GEMM merges
    w: jax.Array  # [K, N] bf16
    splits: int  # K ranges per 64-column block
    row0: bool = False

    @property
    def rows(self) -> int:
        return MERGE_ROWS if isinstance(self.x, MergedRows) else int(self.x.shape[0])

    @property
    def steps(self) -> int:  # K tiles per piece
        return int(self.w.shape[0]) // SIDE_BK // self.splits

    @property
    def pieces(self) -> int:
        return int(self.w.shape[1]) // ROWS * self.splits

    def smem_bytes(self) -> int:
        return _side_smem(self.steps, self.rows)


def _side_smem(steps: int, rows: int) -> int:
    return steps * (SIDE_BK * ROWS * 2 + rows * SIDE_BK * 2) + ROWS * rows * 4 + 8 * steps + 128


def side_problem(side: SideProduct) -> str | None:
    """Why `_grouped_gemm` cannot stream this side product (None: it can)."""
    w = side.w
    x: jax.Array | jax.ShapeDtypeStruct
    if isinstance(side.x, MergedRows):
        m = side.x
        if side.row0 and m.rows != 1:
            return f"row-0 partials need one merged row, got {m.rows}"
        if not merge_supported(m.o, m.lse, w) or not 1 <= m.rows <= MERGE_ROWS:
            return (f"merged rows: partials o {m.o.shape} {m.o.dtype} / lse {m.lse.shape} with {m.rows} rows do not "
                    f"fit w {w.shape} {w.dtype} (o [8, H, S, 64] f32, w [H * 64, N] bf16, 1 to 8 rows)")
        x = jax.ShapeDtypeStruct((MERGE_ROWS, w.shape[0]), jnp.bfloat16)  # what the up GEMM hands over
    else:
        x = side.x
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        return f"x {x.shape} and w {w.shape} are not a [Mp, K] x [K, N] product"
    if jnp.dtype(x.dtype) != jnp.dtype(jnp.bfloat16) or jnp.dtype(w.dtype) != jnp.dtype(jnp.bfloat16):
        return f"x and w must be bf16, got {x.dtype} / {w.dtype}"
    if x.shape[0] % 8 or not 8 <= x.shape[0] <= 64:
        return f"x needs a multiple of 8 rows in [8, 64], got {x.shape[0]}"
    if w.shape[1] % ROWS or side.splits < 1 or w.shape[0] % (SIDE_BK * side.splits):
        return (f"w {w.shape} needs N a multiple of {ROWS} and K a multiple of {SIDE_BK} x splits "
                f"({side.splits})")
    if side.smem_bytes() > SIDE_SMEM_MAX:
        return f"{side.steps} K tiles per piece need {side.smem_bytes()} B of SMEM (at most {SIDE_SMEM_MAX})"
    return None


def side_splits(k: int, n: int, rows: int, num_ctas: int) -> int | None:
    """K ranges per column block for a side product [rows, k] x [k, n]: the most that keep one
    piece per CTA (more CTAs share the stream), else the fewest whose tiles fit in SMEM (CTAs then
    take several pieces); None where no split fits."""
    steps, blocks = k // SIDE_BK, n // ROWS
    if k % SIDE_BK or n % ROWS or not steps:
        return None
    fits = [s for s in (1 << i for i in range(steps.bit_length())) if steps % s == 0
            and _side_smem(steps // s, rows) <= SIDE_SMEM_MAX]
    one_each = [s for s in fits if blocks * s <= num_ctas]
    return max(one_each) if one_each else (min(fits) if fits else None)


RoutingImpl = Literal["tables", "mosaic", "xla"]  # dense-regime routing implementations
ROUTINGS: tuple[str, ...] = get_args(RoutingImpl)


class MoEKernelError(ValueError):
    """Shapes, dtypes or a configuration the MoE kernels do not support."""


@dataclasses.dataclass(frozen=True)
class MoEKernelConfig:
    block_tokens: int  # Nt: tokens per block, the wgmma N (multiple of 8, <= 256)
    dense: bool = False  # one block of all T tokens per active expert (needs Nt >= T); else sorted
    w8a8: bool = True  # FP8 experts: quantise activations (else dequantise weights in registers)
    # Dense-regime routing in `moe_layer`: "tables" (XLA router GEMM + one Triton program for
    # top-k and the block tables), "mosaic" (all of it in one Mosaic CTA), "xla" (route_ref +
    # group_dense in jnp). The sorted regime always routes with route_ref + group_by_expert.
    routing: RoutingImpl = "tables"
    route_warps: int = 0  # warps of the routing tables program (0: its default)
    num_ctas: int = H100_SMS  # persistent grid size (one CTA per SM)
    max_stages: int = 8  # depth of the TMA ring
    # W8A16: bf16 staging tiles the e4m3 weights are upcast into. 2 lets step s+1's upcast run
    # while step s's MMAs do; 1 serialises them (half the staging SMEM).
    staging_buffers: int = 2
    # Down projection: 64-row weight tiles per work unit (each pipeline step loads all of them).
    down_row_tiles: int = 2
    # W8A16 operands in f16 instead of bf16: e4m3 -> f16 is exact and one conversion instruction
    # per two weights (e4m3 -> bf16 goes through f32). Token rows and the intermediate activation
    # are f16 then: exact for bf16 tokens of magnitude in [2^-14, 65504], saturated beyond it.
    f16_operands: bool = True
    # Dense W8A8: quantise the token rows and the activation inside the GEMMs (`_grouped_gemm`'s
    # quantize_b) instead of in two launches of their own, where the rows fit in SMEM beside the
    # ring (`quant_in_gemm_fits`). `default_config` takes it from KESTREL_JAX_MOE_GEMM_QUANT.
    quant_in_gemm: bool = True
    # Sorted regime only: a CTA's round-robin units go output slice fastest (the CTAs running at one
    # time cover a few blocks, all slices of each, so a block's token rows are read from DRAM once
    # and its expert's weight tiles are shared by the expert's blocks through L2) instead of block
    # fastest (each pass over the blocks, one per output slice, re-reads every block's rows: at
    # T = 1480 ~1.6x the layer's ideal DRAM bytes). `default_config` takes it from
    # KESTREL_JAX_MOE_SORTED_ORDER (see `sorted_slices_fastest`).
    slices_fastest: bool = True


def default_config(num_tokens: int, num_ctas: int | None = None) -> MoEKernelConfig:
    """Regime by static token count T.

    T <= 64: dense blocks (weight streaming; every active expert is read once). FP8 runs W8A8.
    History of the W8A16 / W8A8 split (H100) — fourth session: W8A16 38.9 vs W8A8 40.1 us at
    T = 1 (the two activation-quantisation passes cost more than the upcast saves), but W8A8
    93.2 vs 105.5 us at T = 4 and 158 vs 186 us at T = 16: the upcast of every weight tile into
    SMEM costs more than the weight stream hides once eight tokens' experts stream at once.
    Eighteenth session (the quantisation passes one Triton launch each by then): T = 1 36.1 vs
    36.5 us (a tie; W8A16 kept, its error is 5x smaller), T = 2 56.2 vs 53.7, T = 3 75.5 vs 69.2,
    so the threshold moved from 4 to 2 tokens. Nineteenth session, the quantisation inside the
    GEMMs (`quant_in_gemm`): T = 1 33.4 vs 35.9 us, W1 (batch-1 decode) 654.5 / 658.9 vs 629.4 /
    635.6 tok/s, so W8A8 from one token (the error against the bf16 reference grows from ~9e-3
    to ~4.5e-2, the per-token activation rounding that W8A8 means at every other T).
    T > 64: expert-sorted blocks of 64 / 128 tokens, W8A8 (FP8 wgmma throughput).
    KESTREL_JAX_W8A8_MIN_TOKENS (read at trace time, default 1; 2 restores W8A16 at one token)
    moves the dense regime's W8A8 threshold; KESTREL_JAX_MOE_DENSE_STAGES (default 8, 2-16) sets
    its TMA ring depth (`max_stages`), for A/B runs: the fifty-sixth session found the rows
    kernel, 224 CTAs streaming at once, faster with 6 slots than 8 (its first tiles queue behind
    fewer loads), and the dense regime's 132 CTAs x 8 slots ask for ~17 MB of an FP8 up GEMM's
    ~34 MB at once.
    """
    ctas = num_ctas or _device_sms()
    if num_tokens <= 64:
        nt = max(ROW_ALIGN, -(-num_tokens // ROW_ALIGN) * ROW_ALIGN)
        return MoEKernelConfig(block_tokens=nt, dense=True, w8a8=num_tokens >= _w8a8_min_tokens(), num_ctas=ctas,
                               quant_in_gemm=quant_in_gemm_wanted(),
                               max_stages=integer("KESTREL_JAX_MOE_DENSE_STAGES", 8, low=2, high=16))
    return MoEKernelConfig(block_tokens=sorted_block_tokens(num_tokens), w8a8=True, num_ctas=ctas,
                           slices_fastest=sorted_slices_fastest())


def sorted_slices_fastest() -> bool:
    """The sorted regime's unit order, read at trace time: KESTREL_JAX_MOE_SORTED_ORDER=slices
    (default) or blocks (the order before the twenty-sixth session, for A/B runs). H100, twenty-
    sixth session, FP8 layer (128-token blocks): T = 740 262.6 -> 239.5 us (Kestrel 245), T = 1480
    385.1 -> 319.2; the W2 prefill step's grouped GEMMs 5,610 -> 4,733 us. Also measured then and
    not kept: two CTAs per SM with half the SMEM ring each (T = 1480 423.6 us block order, 367.4
    slices order)."""
    return choice("KESTREL_JAX_MOE_SORTED_ORDER", "slices", ("blocks", "slices")) == "slices"


def sorted_block_tokens(num_tokens: int) -> int:
    """Nt of the sorted regime: 64 up to 256 tokens, else 128. KESTREL_JAX_MOE_SORTED_NT (64 or
    128, read at trace time) fixes it for A/B runs. H100, twenty-fifth session, W2's prefill step
    (two 740-token prompts, T = 1536): 5.618 ms of grouped GEMMs with 128, 5.616 with 64, though
    64 computes ~25% fewer padded rows (each expert's ~185 rows take 3 x 64 instead of 2 x 128).
    Nsight Compute on the T = 1480 layer: tensor pipe 42-48% busy (35% with 64), DRAM at 68-72%
    of its peak, one warpgroup per SM issuing (occupancy 6.25%). Two consumer warpgroups (sharing
    either the token tile or the weight tile) were no faster (BENCHMARKS.md). All of that was with
    the units in block-fastest order; in slice-fastest order (twenty-sixth session) 128 stays ahead
    (T = 740 239.5 vs 261.7 us, T = 1480 319.2 vs 337.6), and the token-sharing two-consumer kernel
    stays behind (T = 740 248.5 vs 239.3, T = 1480 331.3 vs 324.0; history: afc66de)."""
    return int(choice("KESTREL_JAX_MOE_SORTED_NT", "64" if num_tokens <= 256 else "128", ("64", "128")))


def _w8a8_min_tokens() -> int:
    return integer("KESTREL_JAX_W8A8_MIN_TOKENS", 1)


def _device_sms() -> int:
    try:
        dev = jax.devices()[0]
        if dev.platform == "gpu":
            return int(getattr(dev, "core_count", H100_SMS))
    except RuntimeError:
        pass
    return H100_SMS


def moe_kernel_supported(x: jax.Array, experts: ExpertWeights, top_k: int) -> bool:
    """Whether the kernels handle these shapes/dtypes (else use `moe_layer_ref`)."""
    T, D = x.shape
    E, two_i, d2 = experts.up_w.shape
    ok = (
        d2 == D
        and experts.down_w.shape == (E, D, two_i // 2)
        and two_i % (2 * ROWS) == 0
        and D % ROWS == 0
        and D % 128 == 0
        and (two_i // 2) % 128 == 0
        and 1 <= top_k <= E
        and experts.up_w.dtype in (jnp.bfloat16, FP8)
        and experts.down_w.dtype == experts.up_w.dtype
    )
    if experts.up_w.dtype == FP8:
        ok = ok and experts.up_scale is not None and experts.down_scale is not None
    return bool(ok and T >= 1)


def _tile_transforms(cols: int, dtype: jnp.dtype) -> tuple:
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(cols * bits)
    # mypy sees these transforms' abstract base; they are concrete at runtime.
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))  # type: ignore[abstract]


def _grouped_gemm(
    meta: jax.Array,  # [chunks, 3, CH] int32: block expert, block's first B row, [num_blocks, 0...]
    w: jax.Array,  # [E, N, K] bf16 | e4m3
    w_scale: jax.Array | None,  # [E, N] f32 (e4m3 weights)
    b: jax.Array,  # [R, K] bf16 | e4m3 token rows
    b_scale: jax.Array | None,  # [R] f32 per-row scale of e4m3 tokens
    *,
    glu: bool,  # up projection: rows [0, N/2) -> h, [N/2, N) -> g, out GELU(h) * (g + 1)
    block_tokens: int,
    num_out_rows: int,  # NB * Nt
    num_ctas: int,
    max_stages: int,
    staging_buffers: int = 2,
    row_tiles: int = 1,  # down projection (glu=False): 64-row weight tiles per unit
    # Programmatic dependent launch (H100): `pdl_trigger` lets the next kernel launch while this one
    # runs; `pdl_wait` makes this kernel read only its block table and weights before waiting for
    # the previous kernel (see `pdl_wanted`). Off in interpret mode (no CPU lowering).
    pdl_trigger: bool = False,
    pdl_wait: bool = False,
    out_dtype: jnp.dtype = jnp.bfloat16,  # bf16, or f16 (saturated at +-65504) for an f16 next GEMM
    # e4m3 weights, bf16 token rows: W8A8 with the rows quantised per row inside the kernel (as
    # `moe.quantize_rows`): a block's Nt rows are loaded whole into SMEM, their maxima taken, and
    # the e4m3 rows kept resident for every unit of that block (see `quant_in_gemm_fits`).
    # `shared_rows`: every block reads the same rows (dense up projection), quantised once per CTA.
    quantize_b: bool = False,
    shared_rows: bool = False,
    slices_fastest: bool = False,  # round-robin units in (block, slice) order, slice fastest
    side: SideProduct | None = None,  # an unrelated decode product streamed in the same launch
    merge: MergedRows | None = None,  # attention partials merged in the same launch (`MergedRows`)
    interpret: object = None,
) -> jax.Array | tuple[jax.Array, ...]:  # [NB * Nt, N or N/2] out_dtype (, side partials) (, merged rows)
    E, N, K = w.shape
    nt = block_tokens
    if side is not None:
        problem = side_problem(side)
        if problem or isinstance(side.x, MergedRows):
            raise MoEKernelError(f"side product: {problem or 'its merged rows come from the up GEMM'}")
    if merge is not None and (not merge_supported(merge.o, merge.lse, jax.ShapeDtypeStruct(
            (merge.o.shape[1] * SIDE_BK, ROWS), jnp.bfloat16)) or not 1 <= merge.rows <= MERGE_ROWS):
        raise MoEKernelError(f"merged rows: partials o {merge.o.shape} {merge.o.dtype} / lse {merge.lse.shape}, "
                             f"{merge.rows} rows")
    if quantize_b and (w.dtype != FP8 or b.dtype != jnp.bfloat16 or b_scale is not None):
        raise MoEKernelError("quantize_b needs e4m3 weights and bf16 token rows without scales")
    # Weight row tiles per unit: the up projection's h and g tiles (rows p * N/2 + j * ROWS); the
    # down projection's `row_tiles` adjacent tiles (rows (j * row_tiles + p) * ROWS), which
    # makes each pipeline step one larger transfer.
    nparts = 2 if glu else row_tiles
    n_out = N // 2 if glu else N
    nj = n_out // ROWS if glu else N // (ROWS * nparts)
    n_tiles_out = 1 if glu else nparts  # [Nt, ROWS] output tiles per unit
    if not glu and N % (ROWS * nparts):
        raise MoEKernelError(f"{N} output rows do not split into tiles of {nparts} x {ROWS}")

    def w_row(p, j):  # first weight row of part p of output slice j
        return p * n_out + j * ROWS if glu else (j * nparts + p) * ROWS
    convert = w.dtype == FP8 and b.dtype != FP8 and not quantize_b  # W8A16: weight tiles upcast in SMEM
    tk = 128 // jnp.dtype(w.dtype).itemsize  # one 128-byte swizzle row of weights per step
    ks = K // tk
    a_bytes = nparts * ROWS * tk * jnp.dtype(w.dtype).itemsize
    b_bytes = 0 if quantize_b else nt * tk * jnp.dtype(b.dtype).itemsize
    n_stage = staging_buffers if convert else 0
    out_bytes = (n_tiles_out * nt * ROWS * 2 + n_stage * nparts * ROWS * tk * 2 + meta.size * 4
                 + (_quant_bytes(nt, K) if quantize_b else 0) + (0 if side is None else side.smem_bytes())
                 + (0 if merge is None else MERGE_ROWS * SIDE_BK * 2))
    stages = min(max_stages, (SMEM_LIMIT - out_bytes - 2048) // (a_bytes + b_bytes))
    if stages < 2:
        raise MoEKernelError(f"block_tokens={nt} leaves no room for a 2-stage pipeline in SMEM")
    has_w_scale, has_b_scale = w_scale is not None, b_scale is not None
    mma_b = FP8 if quantize_b else b.dtype
    a_tr, b_tr, o_tr = _tile_transforms(tk, w.dtype), _tile_transforms(tk, mma_b), _tile_transforms(
        ROWS, out_dtype)
    f16_out = jnp.dtype(out_dtype) == jnp.dtype(jnp.float16)

    n_chunks, _, chunk = meta.shape

    def body(*refs):
        meta_gmem, w_ref, *rest = refs
        ws_ref = rest.pop(0) if has_w_scale else None
        b_ref = rest.pop(0)
        bs_ref = rest.pop(0) if b_scale is not None else None
        sx_ref, sw_ref = (rest.pop(0), rest.pop(0)) if side is not None else (None, None)
        mo_ref, ml_ref = (rest.pop(0), rest.pop(0)) if merge is not None else (None, None)
        out_ref = rest.pop(0)
        so_ref = rest.pop(0) if side is not None else None
        mx_ref = rest.pop(0) if merge is not None else None
        a_buf, b_buf, bar, o_smem, meta_ref, meta_bar, *extra = rest
        if merge is not None:
            *extra, mt_smem = extra
        if side is not None:
            *extra, sw_buf, sx_buf, so_smem, s_bars = extra
        if quantize_b:
            q_stage, b_res, q_scale, q_bar = extra
        a16 = extra if convert else []

        def load_rows(blk):  # the block's bf16 token rows -> q_stage (arrive on q_bar)
            row = pl.multiple_of(block_info(blk, 1), ROW_ALIGN)
            for k in range(ks):
                plgpu.copy_gmem_to_smem(b_ref.at[pl.ds(row, nt), pl.ds(k * tk, tk)], q_stage.at[k], q_bar)

        def quantize_rows_to_smem():
            """The rows `load_rows` brought -> e4m3 in b_res (one [Nt, tk] tile per K step) and their
            scales in q_scale: `moe.quantize_rows`' arithmetic (absmax / 448, times its reciprocal,
            clamped, round to nearest). q_stage may be reloaded afterwards."""
            plgpu.barrier_wait(q_bar)
            for r in range(nt // 8):
                def rows(k, r=r):
                    return plgpu.load(q_stage.at[k, pl.ds(r * 8, 8)], layout=_QROWS,
                                      optimized=False).astype(jnp.float32)
                # Elementwise maxima over the K steps first, then one cross-lane reduction per row.
                tile_max = jnp.abs(rows(0))
                for k in range(1, ks):
                    tile_max = jnp.maximum(tile_max, jnp.abs(rows(k)))
                amax = tile_max.max(axis=1)
                scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
                inv = lax.broadcast_in_dim(1.0 / scale, (8, tk), [0])
                for k in range(ks):
                    q = jnp.minimum(jnp.maximum(rows(k) * inv, -FP8_MAX), FP8_MAX)
                    b_res.at[k, pl.ds(r * 8, 8)][...] = q.astype(FP8)
                q_scale.at[pl.ds(r * 8, 8)][...] = scale
            # Orders these SMEM accesses before wgmma's and the next TMA's (async proxy), and syncs
            # the warpgroup for the epilogue's scale loads.
            plgpu.commit_smem()

        cta = lax.axis_index("cta")
        if side is not None:
            # The side product's pieces go to the CTAs from the last one down (the dense regime's
            # units fill the grid from the first); its weights and rows depend on no block table,
            # so the first piece's whole K range is in flight before the table arrives.
            n_side, s_steps = side.pieces, side.steps
            assert sx_ref is not None and sw_ref is not None and so_ref is not None
            s_first = num_ctas - 1 - cta
            s_mine = lax.div(jnp.maximum(n_side - s_first + num_ctas - 1, 0), num_ctas)

            def side_at(j):  # j-th piece of this CTA -> (first column, first K row, split)
                piece = s_first + j * num_ctas
                split = lax.rem(piece, side.splits)
                return (pl.multiple_of(lax.div(piece, side.splits) * ROWS, ROWS),
                        pl.multiple_of(split * (s_steps * SIDE_BK), SIDE_BK), split)

            def side_fill(j):
                n0, k0, _ = side_at(j)
                for i in range(s_steps):
                    rows_k = pl.ds(pl.multiple_of(k0 + i * SIDE_BK, SIDE_BK), SIDE_BK)
                    plgpu.copy_gmem_to_smem(sw_ref.at[rows_k, pl.ds(n0, ROWS)], sw_buf.at[i], s_bars.at[i])
                    plgpu.copy_gmem_to_smem(sx_ref.at[:, rows_k], sx_buf.at[i], s_bars.at[i])

            pl.when(s_mine > 0)(lambda: side_fill(0))

        # The block table lives in SMEM: the TMA issue path reads it every step, and an SMEM
        # scalar load is ~30 cycles where a global one can be hundreds.
        for c in range(n_chunks):
            plgpu.copy_gmem_to_smem(meta_gmem.at[c], meta_ref.at[c], meta_bar)
        plgpu.barrier_wait(meta_bar)

        def block_info(blk, field):  # field 0: expert, 1: first B row
            if n_chunks == 1:
                return meta_ref[0, field, blk]
            return meta_ref[lax.div(blk, chunk), field, lax.rem(blk, chunk)]

        nb = meta_ref[0, 2, 0]
        units = nb * nj
        # Traced integer math uses lax.div/rem (all operands >= 0): jnp's floor-mod helper does
        # not lower inside Mosaic GPU loops.
        # Per-block quantisation (down projection): each CTA takes a contiguous range of units,
        # output slice fastest, so it quantises each of its blocks once (dense blocks are distinct
        # experts, so the round-robin order's L2 sharing of one expert's tiles does not apply).
        contiguous = quantize_b and not shared_rows
        if contiguous:
            per, extra_units = lax.div(units, num_ctas), lax.rem(units, num_ctas)
            first = cta * per + jnp.minimum(cta, extra_units)
            mine = per + (cta < extra_units).astype(jnp.int32)
        else:
            mine = lax.div(jnp.maximum(units - cta + num_ctas - 1, 0), num_ctas)
        total = mine * ks

        def unit(i):  # i-th unit of this CTA -> (block, output slice)
            if contiguous:
                u = first + i
                return lax.div(u, nj), lax.rem(u, nj)
            u = cta + i * num_ctas
            if slices_fastest:
                return lax.div(u, nj), lax.rem(u, nj)
            return lax.rem(u, nb), lax.div(u, nb)

        def fetch(s, weights=True, tokens=True):  # issue the TMA loads of global step s into its ring slot
            slot = lax.rem(s, stages)
            blk, j = unit(lax.div(s, ks))
            k = lax.rem(s, ks)
            if weights:
                e = block_info(blk, 0)
                for p in range(nparts):
                    plgpu.copy_gmem_to_smem(
                        w_ref.at[e, pl.ds(w_row(p, j), ROWS), pl.ds(k * tk, tk)],
                        a_buf.at[slot, p], bar.at[slot])
            if tokens and not quantize_b:
                row = pl.multiple_of(block_info(blk, 1), ROW_ALIGN)
                plgpu.copy_gmem_to_smem(b_ref.at[pl.ds(row, nt), pl.ds(k * tk, tk)], b_buf.at[slot],
                                        bar.at[slot])

        def first_rows():  # the first block's rows, ahead of the weight ring in the TMA queue
            if quantize_b:
                @pl.when(mine > 0)
                def _first_rows():
                    load_rows(unit(0)[0])

        if not pdl_wait:
            first_rows()
        if pdl_trigger and not interpret:  # the next kernel may launch now (it waits for our results)
            plgpu.griddepcontrol_launch_dependents()
        if pdl_wait:
            # The block table and the weights come from earlier kernels or parameters (never from the
            # previous kernel, see `pdl_wanted`): their first ring slots fill while it finishes.
            @pl.loop(0, jnp.minimum(total, stages))
            def _prologue_weights(s):
                fetch(s, tokens=False)

            if not interpret:
                plgpu.griddepcontrol_wait()
            first_rows()  # token rows may come from the previous kernel

            @pl.loop(0, jnp.minimum(total, stages))
            def _prologue_tokens(s):
                fetch(s, weights=False)
        else:
            @pl.loop(0, jnp.minimum(total, stages))
            def _prologue(s):
                fetch(s)

        if quantize_b and shared_rows:  # while the ring's first weight tiles arrive
            @pl.when(mine > 0)
            def _quantize_once():
                quantize_rows_to_smem()

        if merge is not None:  # while the ring's first tiles arrive: the heads on the CTAs from the last one down
            n_heads, n_splits = merge.o.shape[1], merge.o.shape[2]
            m_first = num_ctas - 1 - cta
            m_mine = lax.div(jnp.maximum(n_heads - m_first + num_ctas - 1, 0), num_ctas)

            @pl.loop(0, m_mine)
            def _merge_loop(j):
                head = m_first + j * num_ctas
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous head's store has read the tile
                mt_smem[...] = _merged_tile(mo_ref, ml_ref, head, merge.rows, n_splits)
                plgpu.commit_smem()
                assert mx_ref is not None
                plgpu.copy_smem_to_gmem(mt_smem, mx_ref.at[:, pl.ds(pl.multiple_of(head * SIDE_BK, SIDE_BK), SIDE_BK)])

        if side is not None:  # while the ring's first tiles arrive
            @pl.loop(0, s_mine)
            def _side_loop(j):
                pl.when(j > 0)(lambda: side_fill(j))  # (the previous piece's MMAs are done)
                n0, _, split = side_at(j)

                def side_scope(acc_ref):
                    gemv_stream(acc_ref, sw_buf, sx_buf, s_bars, _no_fetch, s_steps, s_steps, resident=True)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous piece's store
                    if side.row0:  # row 0 of y^T's block: the padding rows' columns are exact zeros
                        so_smem[...] = jnp.sum(acc_ref[...], axis=1)
                    else:
                        so_smem[...] = acc_ref[...]

                pl.run_scoped(side_scope, plgpu.ACC((ROWS, side.rows), jnp.float32))
                plgpu.commit_smem()
                assert so_ref is not None
                plgpu.copy_smem_to_gmem(so_smem, so_ref.at[split, pl.ds(n0, ROWS)])

        @pl.loop(0, mine)
        def _unit_loop(i):
            blk, j = unit(i)
            e = block_info(blk, 0)
            row = pl.multiple_of(block_info(blk, 1), ROW_ALIGN)
            if contiguous:
                @pl.when((i == 0) | (j == 0))  # a new block: the previous unit's MMAs are done (its
                def _quantize_block():        # epilogue read the accumulators), so b_res is free
                    quantize_rows_to_smem()

                    @pl.when((j == 0) & (i + nj < mine) | (i == 0) & (i + nj - j < mine))
                    def _next_rows():  # this CTA's next block, loading while this one computes
                        load_rows(blk + 1)
            # Epilogue vectors, loaded before the K loop so their latency hides behind it.
            row_scales = [
                plgpu.load(ws_ref.at[e, pl.ds(w_row(p, j), ROWS)],
                           layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
                for p in range(nparts)
            ] if ws_ref is not None else []
            col_scale = None
            if quantize_b:
                col_scale = plgpu.load(q_scale, layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
            elif bs_ref is not None:
                col_scale = plgpu.load(bs_ref.at[pl.ds(row, nt)], layout=plgpu.Layout.WGMMA.reduce(0),
                                       optimized=False)

            def acc_scope(*accs):
                @pl.loop(0, ks)
                def _k_loop(k):
                    s = i * ks + k
                    slot = lax.rem(s, stages)
                    plgpu.barrier_wait(bar.at[slot])
                    # [tk, Nt] view of the K-major token rows
                    b_tile = b_res.at[k].T if quantize_b else b_buf.at[slot].T
                    if convert:
                        # Upcast the e4m3 tile into a 16-bit staging tile, then fence it for wgmma.
                        stage = a16[0].at[lax.rem(s, n_stage)]
                        for p in range(nparts):
                            wt = a_buf.at[slot, p][...]
                            # e4m3 -> f16 is one instruction; this ptxas has no e4m3 -> bf16.
                            stage.at[p][...] = (wt.astype(mma_b) if mma_b == jnp.float16
                                                else wt.astype(jnp.float32).astype(mma_b))
                        plgpu.commit_smem()
                    for p in range(nparts):
                        plgpu.wgmma(accs[p], stage.at[p] if convert else a_buf.at[slot, p], b_tile)
                    # After this wait step s-1's MMAs are done, so its slot may be refilled (and,
                    # converting, its staging tile rewritten; with one staging tile, all MMAs).
                    plgpu.wgmma_wait(0 if convert and n_stage == 1 else nparts)

                    @pl.when((s >= 1) & (s - 1 + stages < total))
                    def _refill():
                        fetch(s - 1 + stages)

                vals = []
                for p in range(nparts):
                    v = accs[p][...]
                    if row_scales:
                        v = v * lax.broadcast_in_dim(row_scales[p], (ROWS, nt), [0])
                    if col_scale is not None:
                        v = v * lax.broadcast_in_dim(col_scale, (ROWS, nt), [1])
                    vals.append(v)
                res = [gelu_erf_poly(vals[0]) * (vals[1] + 1.0)] if glu else vals
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # previous unit's store read o_smem
                for p, r in enumerate(res):
                    if f16_out:  # saturate: the next GEMM must not meet inf
                        r = jnp.minimum(jnp.maximum(r, -F16_MAX), F16_MAX)
                    o_smem.at[p].T[...] = r.astype(out_dtype)
                plgpu.commit_smem()
                for p in range(n_tiles_out):
                    col = j * ROWS if glu else w_row(p, j)
                    plgpu.copy_smem_to_gmem(o_smem.at[p], out_ref.at[pl.ds(blk * nt, nt), pl.ds(col, ROWS)])

            pl.run_scoped(acc_scope, *[plgpu.ACC((ROWS, nt), jnp.float32) for _ in range(nparts)])

        plgpu.wait_smem_to_gmem(0)

    quant_scratch: list[Any] = [
        plgpu.SMEM((ks, nt, tk), b.dtype), plgpu.SMEM((ks, nt, tk), FP8, transforms=b_tr),
        plgpu.SMEM((nt,), jnp.float32), plgpu.Barrier(num_arrivals=ks)] if quantize_b else []
    side_scratch: list[Any] = [] if side is None else [
        plgpu.SMEM((side.steps, SIDE_BK, ROWS), jnp.bfloat16, transforms=GEMV_TRANSFORMS),
        plgpu.SMEM((side.steps, side.rows, SIDE_BK), jnp.bfloat16, transforms=GEMV_TRANSFORMS),
        plgpu.SMEM((ROWS,) if side.row0 else (ROWS, side.rows), jnp.float32),
        plgpu.Barrier(num_arrivals=2, num_barriers=side.steps)]
    merge_scratch: list[Any] = [] if merge is None else [plgpu.SMEM((MERGE_ROWS, SIDE_BK), jnp.bfloat16)]
    outs: list[jax.ShapeDtypeStruct] = [jax.ShapeDtypeStruct((num_out_rows, n_out), out_dtype)]
    if side is not None:
        outs.append(jax.ShapeDtypeStruct((side.splits, side.w.shape[1]) + (() if side.row0 else (side.rows,)),
                                         jnp.float32))
    if merge is not None:
        outs.append(jax.ShapeDtypeStruct((MERGE_ROWS, merge.o.shape[1] * SIDE_BK), jnp.bfloat16))
    kernel = plgpu.kernel(
        body,
        out_type=outs[0] if len(outs) == 1 else tuple(outs),
        scratch_types=[
            plgpu.SMEM((stages, nparts, ROWS, tk), w.dtype, transforms=a_tr),
            # (with quantize_b the token tiles come from the resident e4m3 rows: one unused slot)
            plgpu.SMEM((stages if not quantize_b else 1, nt, tk), mma_b, transforms=b_tr),
            plgpu.Barrier(num_arrivals=nparts + (0 if quantize_b else 1), num_barriers=stages),
            plgpu.SMEM((n_tiles_out, nt, ROWS), out_dtype, transforms=o_tr),
            plgpu.SMEM(meta.shape, jnp.int32),
            plgpu.Barrier(num_arrivals=n_chunks),
            *([plgpu.SMEM((n_stage, nparts, ROWS, tk), b.dtype, transforms=_tile_transforms(tk, b.dtype))]
              if convert else []),
            *quant_scratch,
            *side_scratch,
            *merge_scratch,
        ],
        grid=(num_ctas,),
        grid_names=("cta",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=mgpu_interpret.resolve(interpret),
    )
    args = [meta, w] + ([w_scale] if has_w_scale else []) + [b] + ([b_scale] if has_b_scale else [])
    if side is not None:
        assert not isinstance(side.x, MergedRows)
        args += [side.x, side.w]
    if merge is not None:
        args += [merge.o, merge.lse]
    return kernel(*args)


def _no_fetch(i: Any, slot: Any) -> None:
    """A ring that is never refilled: the side product's tiles are all resident."""


def _quant_bytes(nt: int, k: int) -> int:
    """SMEM of `_grouped_gemm`'s in-kernel quantisation: bf16 rows, their e4m3 copy, scales, and the
    ring's (then unused) one-slot token tile."""
    return nt * k * 2 + nt * k + nt * 4 + nt * 128


def quant_in_gemm_fits(nt: int, k: int, nparts: int, max_stages: int = 8) -> bool:
    """Whether `_grouped_gemm(quantize_b=True)` over [*, k] e4m3 weights (nparts 64-row tiles per
    step) with blocks of nt rows keeps a ring of min(max_stages, MIN_QUANT_STAGES) stages. At the
    production shapes (D = 2048, I = 1024): the up GEMM up to 24 rows, the down GEMM up to 40."""
    a_bytes = nparts * ROWS * 128
    meta_bytes = 3 * 256 * 4  # the largest one-chunk block table
    room = SMEM_LIMIT - 2048 - meta_bytes - nparts * nt * ROWS * 2 - _quant_bytes(nt, k)
    return nt % 8 == 0 and k % 128 == 0 and room // a_bytes >= min(max_stages, MIN_QUANT_STAGES)


def quant_in_gemm_wanted() -> bool:
    """`default_config`'s `quant_in_gemm`, read at trace time: KESTREL_JAX_MOE_GEMM_QUANT=0 has the
    dense W8A8 regime quantise its token rows and activation in launches of their own
    (`quantize_triton`) for A/B runs."""
    return flag("KESTREL_JAX_MOE_GEMM_QUANT", True)


META_CHUNK = 256  # TMA box limit per dimension


def _meta(block_expert: jax.Array, block_row: jax.Array, num_blocks: jax.Array) -> jax.Array:
    """[chunks, 3, CH] int32 block table: rows expert, first B row, [num_blocks, 0, ...]."""
    nb = block_expert.shape[0]
    chunk = META_CHUNK if nb > META_CHUNK else -(-nb // 8) * 8  # TMA rows: multiples of 16 bytes
    n_chunks = -(-nb // chunk)
    pad = n_chunks * chunk - nb
    count_row = jnp.zeros((nb,), jnp.int32).at[0].set(num_blocks[0])
    table = jnp.pad(jnp.stack([block_expert, block_row, count_row]).astype(jnp.int32), ((0, 0), (0, pad)))
    return table.reshape(3, n_chunks, chunk).transpose(1, 0, 2)


def moe(
    x: jax.Array,  # [T, D]
    routing: Routing,
    experts: ExpertWeights,
    *,
    num_valid_tokens: jax.Array | int | None = None,  # rows >= it are padding (output zeros)
    config: MoEKernelConfig | None = None,
    interpret: object = None,
) -> jax.Array:  # [T, D] x.dtype
    """Kernel twin of `moe_ref` (plus padding-token support)."""
    T, D = x.shape
    E = experts.up_w.shape[0]
    top_k = routing.experts.shape[1]
    if not moe_kernel_supported(x, experts, top_k):
        raise MoEKernelError(
            f"unsupported MoE shapes/dtypes: x {x.shape}, up_w {experts.up_w.shape} {experts.up_w.dtype}, "
            f"down_w {experts.down_w.shape}; need D, I multiples of 128 and bf16 or e4m3 (+ scales) experts")
    cfg = config or default_config(T)
    nt = cfg.block_tokens
    if nt % ROW_ALIGN or not ROW_ALIGN <= nt <= 256 or (cfg.dense and nt < T):
        raise MoEKernelError(f"block_tokens must be a multiple of {ROW_ALIGN} in [8, 256] (and >= T={T} "
                             f"for the dense regime), got {nt}")
    w8a8 = experts.is_fp8 and cfg.w8a8
    xb = x.astype(jnp.bfloat16)
    compact_act: jax.Array | None = None

    if cfg.dense:
        dense = group_dense(routing.experts, E, nt, num_valid_tokens)
        n_blocks = min(E, T * top_k)
        dest, valid = dense.dest, dense.valid
        # Up: every block reads the same Nt token rows; down: block b reads the rows up wrote.
        meta_up = _meta(dense.block_expert, jnp.zeros((n_blocks,), jnp.int32), dense.num_blocks)
        meta_down = _meta(dense.block_expert, jnp.arange(n_blocks, dtype=jnp.int32) * nt, dense.num_blocks)
        x_rows, row_token = jnp.pad(xb, ((0, nt - T), (0, 0))), None  # [Nt, D]
    else:
        grp = group_by_expert(routing.experts, E, nt, num_valid_tokens)
        _, n_blocks = grouping_sizes(T, top_k, E, nt)
        dest, valid = grp.dest, grp.valid
        meta_up = _meta(grp.block_expert, grp.block_row, grp.num_blocks)
        # W8A8 re-compacts the activation (quantising it), bf16 reads it where the up GEMM wrote it.
        meta_down = meta_up if w8a8 else _meta(
            grp.block_expert, jnp.arange(n_blocks, dtype=jnp.int32) * nt, grp.num_blocks)
        x_rows, row_token = xb, grp.row_token  # gathered to [C, D] compact rows
        compact_act = grp.row_block if w8a8 else None

    y, _ = _expert_gemms(x_rows, row_token, meta_up, meta_down, compact_act, experts, cfg, n_blocks, interpret)
    return _combine(y, dest, routing.weights, valid, x.dtype)


def _expert_gemms(
    x_rows: jax.Array,  # [R, D] bf16 token rows
    row_token: jax.Array | None,  # [C] row of x_rows for each compact row the up GEMM reads (sorted)
    meta_up: jax.Array,
    meta_down: jax.Array,
    compact_act: jax.Array | None,  # [C] block row of each compact row (sorted W8A8), else None
    experts: ExpertWeights,
    cfg: MoEKernelConfig,
    n_blocks: int,
    interpret: object,
    x_f16: jax.Array | None = None,  # x_rows as the W8A16 f16 operand, already formed (dense regime)
    side: SideProduct | None = None,  # streamed in the down GEMM's launch (`SideProduct`)
) -> tuple[jax.Array, jax.Array | None]:  # ([NB * Nt, D] bf16 expert outputs (block rows), side partials)
    """The up and down GEMMs. A side product whose x is `MergedRows` has the up GEMM's launch merge
    them and the down GEMM's side product read what it wrote."""
    gemm = functools.partial(_grouped_gemm, block_tokens=cfg.block_tokens, num_out_rows=n_blocks * cfg.block_tokens,
                             num_ctas=cfg.num_ctas, max_stages=cfg.max_stages,
                             staging_buffers=cfg.staging_buffers, slices_fastest=cfg.slices_fastest and not cfg.dense,
                             interpret=interpret)
    if pdl_wanted():  # the down GEMM may launch while the up GEMM runs and prefetch its weights
        up_gemm = functools.partial(gemm, pdl_trigger=True)
        gemm = functools.partial(gemm, pdl_wait=True)
    else:
        up_gemm = gemm
    merge = side.x if side is not None and isinstance(side.x, MergedRows) else None
    merged: list[jax.Array] = []  # the up GEMM's merged rows, for the down GEMM's side product

    def down(*args, **kw) -> tuple[jax.Array, jax.Array | None]:
        side_now = side if merge is None or side is None else side._replace(x=merged[0])
        out = gemm(*args, side=side_now, **kw)
        if isinstance(out, tuple):
            assert len(out) == 2
            return out[0], out[1]
        return out, None

    def up(*args, **kw) -> jax.Array:
        out = up_gemm(*args, merge=merge, **kw)
        if merge is None:
            assert not isinstance(out, tuple)
            return out
        assert isinstance(out, tuple) and len(out) == 2
        merged.append(out[1])
        return out[0]
    if experts.is_fp8 and cfg.w8a8:
        nt, (_, two_i, dim) = cfg.block_tokens, experts.up_w.shape
        in_gemm = cfg.quant_in_gemm and cfg.dense and row_token is None and compact_act is None
        if in_gemm and quant_in_gemm_fits(nt, dim, 2, cfg.max_stages):
            act = up(meta_up, experts.up_w, experts.up_scale, x_rows, None, glu=True, quantize_b=True,
                     shared_rows=True)
        else:
            xq, xs = _quantize(x_rows, None, interpret)  # per token, before any gather: T rows, not C
            if row_token is not None:
                xq, xs = _gather_rows(xq, row_token), xs[row_token]
            act = up(meta_up, experts.up_w, experts.up_scale, xq, xs, glu=True)  # [NB*Nt, I]
        if in_gemm and quant_in_gemm_fits(nt, two_i // 2, cfg.down_row_tiles, cfg.max_stages):
            return down(meta_down, experts.down_w, experts.down_scale, act, None, glu=False,
                        row_tiles=cfg.down_row_tiles, quantize_b=True)
        aq, a_s = _quantize(act, compact_act, interpret)
        return down(meta_down, experts.down_w, experts.down_scale, aq, a_s, glu=False,
                    row_tiles=cfg.down_row_tiles)
    b = x_rows if row_token is None else x_rows[row_token]
    f16 = experts.is_fp8 and cfg.f16_operands
    if f16 and x_f16 is not None and row_token is None and x_f16.shape == b.shape:
        b = x_f16
    elif f16:
        b = jnp.clip(b.astype(jnp.float32), -F16_MAX, F16_MAX).astype(jnp.float16)
    act = up(meta_up, experts.up_w, experts.up_scale, b, None, glu=True,
             out_dtype=jnp.float16 if f16 else jnp.bfloat16)
    return down(meta_down, experts.down_w, experts.down_scale, act, None, glu=False, row_tiles=cfg.down_row_tiles)


def pdl_wanted() -> bool:
    """Whether the MoE's two GEMM kernels use programmatic dependent launch (Hopper): the up GEMM
    lets the next kernel launch as soon as it starts, and the down GEMM, launched that way, loads
    its block table and first weight tiles before `griddepcontrol.wait` (they come from the routing
    kernel and the parameters, finished before the up GEMM began; only the activations come from
    the up GEMM or the quantisation after it). KESTREL_JAX_MOE_PDL=1 (read at trace time) turns it
    on for A/B runs."""
    return flag("KESTREL_JAX_MOE_PDL", False)


def quantize_kernel_wanted() -> bool:
    """Whether the W8A8 activations are quantised by the one-pass Triton kernel
    (`quantize_triton.quantize_rows_kernel`) instead of XLA's reduction + convert passes: an A/B
    switch read at trace time, KESTREL_JAX_QUANT_KERNEL=0 turns it off. H100, twelfth session: the
    decode step at 64 rows 203 us faster (80 fewer launches), the 2 x 740-token prefill step 378 us
    faster, W2 at 64 clients +2.4% (A/B/A/B, 6,434 -> 6,589 output tok/s)."""
    return flag("KESTREL_JAX_QUANT_KERNEL", True)


def _quantize(x: jax.Array, idx: jax.Array | None, interpret: object) -> tuple[jax.Array, jax.Array]:
    """`quantize_rows(x if idx is None else x[idx])`, through the one-pass kernel when wanted."""
    if quantize_kernel_wanted() and quantize_rows_problem(x, idx) is None:
        return quantize_rows_kernel(x, idx, interpret=bool(interpret))
    return quantize_rows(x if idx is None else x[idx])


def _gather_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x[idx] for rows of 1-byte values, moved as 32-bit words (XLA gathers element by element: a
    byte-wise gather of the compact FP8 token rows ran at ~1.6 TB/s, tenth session)."""
    if x.dtype.itemsize != 1 or x.shape[1] % 4:
        return x[idx]
    words = lax.bitcast_convert_type(x.reshape(x.shape[0], x.shape[1] // 4, 4), jnp.uint32)
    return lax.bitcast_convert_type(words[idx], x.dtype).reshape(idx.shape[0], x.shape[1])


def _combine(y: jax.Array, dest: jax.Array, weights: jax.Array, valid: jax.Array, dtype) -> jax.Array:
    """out[t] = sum_k weights[t, k] * y[dest[t, k]]: one gather-multiply-reduce fusion. `where`, not
    a zero weight: rows of padding tokens and rows no kernel wrote may hold NaN."""
    w = weights.astype(jnp.float32)[..., None]
    yk = jnp.where(valid[..., None], w * y[dest].astype(jnp.float32), 0.0)  # [T, k, D]
    return jnp.sum(yk, axis=1).astype(dtype)


def moe_layer(
    x: jax.Array,  # [T, D]
    router_w: jax.Array,  # [D, E]
    router_b: jax.Array,  # [E]
    experts: ExpertWeights,
    *,
    top_k: int,
    num_valid_tokens: jax.Array | int | None = None,
    config: MoEKernelConfig | None = None,
    interpret: object = None,
    logits: jax.Array | None = None,  # [T, E] router_logits(x, ..., widen=False), if already computed
) -> jax.Array:  # [T, D]
    """Routing + grouped up/down GEMMs + weighted sum; regime picked by the static T.

    In the dense regime the routing and block tables come from `config.routing` (see
    MoEKernelConfig); in the sorted regime, and where the routing kernels do not support the
    shapes, from the jnp reference.
    """
    rows = moe_layer_rows(x, router_w, router_b, experts, top_k=top_k, num_valid_tokens=num_valid_tokens,
                          config=config, interpret=interpret, logits=logits)
    if rows is not None:
        return combine_rows(rows, x.shape[0], x.dtype)
    cfg = config or default_config(x.shape[0])
    routing = route_ref(x, router_w, router_b, top_k)
    return moe(x, routing, experts, num_valid_tokens=num_valid_tokens, config=cfg, interpret=interpret)


def moe_layer_rows(
    x: jax.Array,  # [T, D], or [Nt, D] already padded with `tokens` = T
    router_w: jax.Array,
    router_b: jax.Array,
    experts: ExpertWeights,
    *,
    top_k: int,
    num_valid_tokens: jax.Array | int | None = None,
    config: MoEKernelConfig | None = None,
    interpret: object = None,
    logits: jax.Array | None = None,  # [T, E], or [Nt, E] with padding rows past T
    tokens: int | None = None,  # real rows of x (None: all)
    x_f16: jax.Array | None = None,  # x as the W8A16 f16 operand ([Nt, D], see `f16_rows_wanted`)
    route: DenseRoute | None = None,  # the tables routing's result, built by the caller from the same logits
    side: tuple[jax.Array | MergedRows, jax.Array] | None = None,  # (x [Mp, K'], w [K', N']): `SideProduct`
    side_row0: bool = False,  # the side product's row-0 partials alone (`SideProduct.row0`; x one real row)
) -> ExpertRows | None:
    """The dense regime's expert rows before the weighted sum (`decode_residual.ExpertRows`: the
    down GEMM's output, each token's k rows and weights), or None where that regime with the
    routing kernels does not apply (the caller runs `moe_layer`'s other paths). With `side`, the
    down GEMM also streams x @ w (`SideProduct`; its partials in `ExpertRows.side`) where it fits
    (`side_splits`), else `side` stays None and the caller forms the product itself (with
    `MergedRows` as x, from the partials: the up GEMM merges them only for the side product)."""
    T = x.shape[0] if tokens is None else tokens
    D = x.shape[1]
    E = experts.up_w.shape[0]
    cfg = config or default_config(T)
    if cfg.routing not in ROUTINGS:
        raise MoEKernelError(f"routing must be one of {ROUTINGS}, got {cfg.routing!r}")
    nt = cfg.block_tokens
    use_tables = cfg.routing == "tables" and route_tables_supported(nt, E, top_k)
    use_mosaic = cfg.routing == "mosaic" and route_dense_supported(nt, D, E, top_k)
    if not (cfg.dense and (use_tables or use_mosaic)) or x.shape[0] not in (T, nt):
        return None
    if not moe_kernel_supported(x[:T], experts, top_k) or nt < T:
        raise MoEKernelError(f"unsupported MoE layer: x {x.shape}, up_w {experts.up_w.shape}, config {cfg}")
    xb = x.astype(jnp.bfloat16)
    x_rows = xb if x.shape[0] == nt else jnp.pad(xb, ((0, nt - T), (0, 0)))  # [Nt, D]
    n_valid = jnp.asarray(T if num_valid_tokens is None else num_valid_tokens, jnp.int32).reshape(1)
    if route is not None:  # built elsewhere (`qkv_epilogue.decode_qkv_route_kernel`): the tables' layout
        if not use_tables or route.meta_up.shape != (1, 3, E) or route.dest.shape[0] != top_k:
            raise MoEKernelError(f"a precomputed route needs the tables routing at T={T} and [k, P] / [1, 3, E] "
                                 f"tables, got dest {route.dest.shape}, meta {route.meta_up.shape}")
        r = route
    elif use_tables:
        if logits is None:
            lg = router_logits(x_rows, router_w, router_b, widen=False)
        elif logits.shape[0] == nt:  # already padded (`gemv_mgpu.gemv_rows`): rows past T are ignored (n_valid)
            lg = logits.astype(x_rows.dtype)
        else:  # rows past T are padding: the tables ignore them (n_valid)
            lg = jnp.pad(logits[:T].astype(x_rows.dtype), ((0, nt - T), (0, 0)))
        r = route_tables(lg, n_valid, top_k=top_k, block_tokens=nt, num_warps=cfg.route_warps or None,
                         interpret=bool(interpret))
    else:
        r = route_dense(x_rows, router_w, own_buffer(router_b, router_b.dtype), n_valid, top_k=top_k,
                        interpret=interpret)
    side_product = None
    if side is not None:
        side_rows = MERGE_ROWS if isinstance(side[0], MergedRows) else side[0].shape[0]
        splits = side_splits(side[1].shape[0], side[1].shape[1], side_rows, cfg.num_ctas)
        if splits is not None:
            side_product = SideProduct(side[0], side[1], splits, side_row0)
            if side_problem(side_product):
                side_product = None
    gemms = functools.partial(_expert_gemms, x_rows, None, r.meta_up, r.meta_down, None, experts, cfg,
                              min(E, T * top_k), interpret, x_f16=x_f16)
    try:
        y, parts = gemms(side=side_product)
    except MoEKernelError:  # the side product's tiles leave the down GEMM no 2-stage ring: the caller forms it
        if side_product is None:
            raise
        y, parts = gemms(side=None)
    return ExpertRows(y, r.dest, r.weights, n_valid, parts)


def tables_route_block_tokens(num_tokens: int, num_experts: int, top_k: int) -> int | None:
    """The block width Nt when `moe_layer_rows` (default config) routes T tokens with the tables
    program, so a caller may build its `DenseRoute` ahead (`route`); None otherwise."""
    cfg = default_config(num_tokens)
    if cfg.dense and cfg.routing == "tables" and route_tables_supported(cfg.block_tokens, num_experts, top_k):
        return cfg.block_tokens
    return None


def f16_rows_wanted(num_tokens: int, experts: ExpertWeights) -> bool:
    """Whether `moe_layer_rows` at this token count (default config) reads its rows as f16 (FP8
    experts in the W8A16 regime): a caller that normalises the rows itself can hand them over in
    that form too (`x_f16`) instead of having XLA convert them in a launch of its own."""
    cfg = default_config(num_tokens)
    return bool(experts.is_fp8 and cfg.dense and not cfg.w8a8 and cfg.f16_operands)
