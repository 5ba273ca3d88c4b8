"""A dense layer's first MLP product with its activation fused: GELU_tanh(x @ w + b), bf16.

Why: in MD2's prefill and mixed steps (and the vision encoder) XLA runs fc1 as a cuBLAS GEMM with
a BIAS epilogue and the tanh GELU as a separate elementwise pass over the [T, 8192] product
(H200, thirty-fourth session: 20.2 us per MD2 layer in the mixed step, ~4.4% of it; no XLA flag or
formulation made XLA fuse it). Here the GELU runs on the f32 accumulators before the one store.

Kernel (Mosaic GPU, Hopper): a persistent grid of CTAs, each taking output tiles [BM = 256, BN]
round-robin (M fastest, so the CTAs running together share weight column blocks in L2). Three
warpgroups per CTA: a producer issuing the TMA loads of a continuous ring of `stages` K steps
(A: two [128, 64] row halves, B: [64, BN] of the [K, N] weight, N-contiguous: wgmma reads it
MN-major, no transpose), and two consumers, each accumulating its 128 rows x BN with wgmma and
releasing a slot once the next step's MMA is issued and the previous one has finished. The ring
runs on across tiles, so the producer fills the next tile's first steps during the epilogue.

Epilogue (per consumer, in registers): h = acc + b rounded to bf16 (the value the unfused path's
GEMM returns), y = 0.5 h (1 + tanh(sqrt(2/pi) (h + 0.044715 h^3))) in f32 (tanh: the hardware
approximation, max rel. error ~2^-11), rounded once to bf16, stored 64 columns at a time through
SMEM by TMA. XLA's unfused bf16 GELU rounds after each of its steps (jax.nn.gelu computes in the
input's dtype), so ~half of the outputs differ from it by a bf16 step or so (H200: max 0.6% of the
largest output); the reference implementation (PyTorch) computes a bf16 GELU in f32 and rounds
once, as here.

Rows: M need not be a multiple of 256 (M >= 256, a multiple of 8: TMA boxes into and out of
swizzled SMEM start at 8-aligned rows). Up to 64 rows past the last full tile (a mixed step's
1536 prefill + 64 decode rows) form "tail" tiles of [64, BN] scheduled after the full ones, each
consumer taking half the columns (a quarter of a full tile's MMAs, ~0.4 of its time: the loads
bound it). More rows than that: the last full tile is shifted up to end at row M. Either way some
rows may be computed twice, by two CTAs, writing the same values. N must be a multiple of BN and
K of 64 (`problem` says why a shape is refused; the caller then uses XLA). Rows past M or columns
past N cannot be left to TMA's bounds instead: Mosaic GPU views a TMA operand in global memory
tiled by its SMEM tile (8 rows x 64 columns here) and refuses dimensions that are not multiples of
it at lowering. So the vision encoder's fc1 (4 x 729 rows x 4,304 columns in a 4-image step; its
GELU pass is 18.5 us of a ~237 us layer) stays on XLA: taking it would need each crop's 729 tokens
padded to 736 through the encoder (attention masking the pad keys) and fc1 padded to 4,352 columns
(checked at lowering, thirty-ninth session; not built: ~1% of MD2 W2's device time at best).

Measured (H200, thirty-eighth session, `tools/bench_linear_gelu.py`, us per MD2 layer, fc1
[M, 2048] x [2048, 8192] + bias + GELU): 4 stages (the default) 49.6 / 75.2 / 88.2 / 98.8 at
M = 768 / 1536 / 1600 / 2048 (519 / 686 / 609 / 695 TFLOP/s) against XLA's cuBLAS GEMM + GELU pass
61.9 / 104.3 / 106.9 / 131.8 in the same harness; 3 stages 59.0 / 87.6 / 111.7 / 114.1 (the ring
is what bounds it: 2 stages 93-183). Inside the steps XLA's GEMM is faster than in that harness
(cuBLAS 67.4 us at 1536 rows, 70.6 at 1600, ~760-800 TFLOP/s, + its GELU pass 18-20.5): the MD2
prefill step (1,536 tokens) -2.5% (12,005.5 -> 11,703.1 us), the mixed step (1,536 + 64 rows)
-0.5% (15,488.9 -> 15,412.9), MD2 W2 unchanged (9,456.5 vs 9,451.7 output tok/s, two runs each).
Not the L2 -> SMEM traffic: a 2-CTA cluster along N, each A tile loaded half by each CTA and
multicast to both (a third less traffic per MMA; commit 7c15a91, removed after measuring), gave the
same outputs and the same times (74.2 vs 74.7 us at 1536 rows, 88.1 vs 88.2 at 1600, 49.1 vs 49.6
at 768). Untried: the two consumers on separate tiles, alternating (one's GELU epilogue under the
other's MMAs), and cheaper tail tiles.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kestrel_jax.pallas import mgpu_interpret
from kestrel_jax.pallas.moe_mgpu import _device_sms, _tile_transforms

WG_ROWS = 128  # rows per consumer warpgroup (two wgmma M tiles of 64)
CONSUMERS = 2
BLOCK_M = WG_ROWS * CONSUMERS
DEFAULT_BLOCK_N = 128
DEFAULT_STAGES = 4
TAIL_ROWS = 64  # rows of a tail tile (see linear_gelu)
TK = 64  # K per step: one 128-byte swizzle row of bf16
SMEM_LIMIT = 227 * 1024
# Registers per thread after setmaxnreg: the consumers hold a [128, BN=128] f32 accumulator (128
# registers) plus the epilogue; the producer only issues copies. 2 x 232 + 40 = 3 x 168, the launch
# allocation of 3 warpgroups (65536 / 384 rounded down to a multiple of 8).
REGISTERS = (232, 40)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


EC = 64  # output columns per store (a [rows, 64] bf16 tile is one 128-byte swizzle row wide)


def out_buffers(block_n: int, stages: int) -> int:
    """Output staging tiles per consumer: two (one store in flight while the next is written), or
    one where two would leave no SMEM for a 4-stage ring at BN = 128."""
    return 2 if block_n == 128 and stages <= 3 else 1


def smem_bytes(block_n: int, stages: int) -> int:
    stage = (BLOCK_M * TK + TK * block_n) * 2
    return stages * stage + CONSUMERS * out_buffers(block_n, stages) * WG_ROWS * EC * 2 + 1024


def problem(x: jax.Array, w: jax.Array, b: jax.Array | None, *, block_n: int = DEFAULT_BLOCK_N,
            stages: int = DEFAULT_STAGES) -> str | None:
    """Why `linear_gelu` cannot run these operands (None: it can)."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        return f"x {x.shape} @ w {w.shape} is not a [M, K] x [K, N] product"
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16 or (b is not None and b.dtype != jnp.bfloat16):
        return "operands must be bf16"
    M, K = x.shape
    N = w.shape[1]
    if b is not None and b.shape != (N,):
        return f"bias {b.shape} does not match N={N}"
    if M < BLOCK_M:
        return f"M={M} < {BLOCK_M} rows (one CTA tile)"
    if M % 8:  # a shifted or tail tile starts at a row of M - 256 or M - 64: TMA boxes into and out
        return f"M={M} is not a multiple of 8 rows"  # of swizzled SMEM need 8-aligned rows
    if block_n not in (64, 128):
        return f"block_n={block_n} must be 64 or 128"
    if N % block_n or K % TK:
        return f"N={N} must be a multiple of {block_n} and K={K} of {TK}"
    if stages < 2:
        return f"stages={stages} < 2"
    if smem_bytes(block_n, stages) > SMEM_LIMIT:
        return f"{stages} stages of block_n={block_n} need {smem_bytes(block_n, stages)} bytes of SMEM"
    return None


def gelu_tanh_f32(h: jax.Array) -> jax.Array:
    return 0.5 * h * (1.0 + jnp.tanh(_SQRT_2_OVER_PI * (h + 0.044715 * (h * h * h))))


def linear_gelu_ref(x: jax.Array, w: jax.Array, b: jax.Array | None) -> jax.Array:
    """The unfused path: the bf16 product (+ bias, rounded once), then GELU_tanh in f32, rounded."""
    h = jnp.dot(x, w, preferred_element_type=jnp.float32)
    if b is not None:
        h = h + b.astype(jnp.float32)
    h = h.astype(x.dtype).astype(jnp.float32)
    return gelu_tanh_f32(h).astype(x.dtype)


def linear_gelu(
    x: jax.Array,  # [M, K] bf16
    w: jax.Array,  # [K, N] bf16
    b: jax.Array | None,  # [N] bf16
    *,
    block_n: int = DEFAULT_BLOCK_N,
    stages: int = DEFAULT_STAGES,
    num_ctas: int | None = None,
    interpret: bool = False,
    detect_races: bool = False,
) -> jax.Array:  # [M, N] bf16
    why = problem(x, w, b, block_n=block_n, stages=stages)
    if why is not None:
        raise ValueError(f"linear_gelu: {why}")
    M, K = x.shape
    N = w.shape[1]
    BN = block_n
    n_ob = out_buffers(block_n, stages)
    n_n = N // BN
    n_mf, rest = divmod(M, BLOCK_M)
    # Rows past the last full 256-row tile: up to 64 of them (a mixed step's 1536 prefill + 64
    # decode rows) are "tail" tiles of 64 rows x BN, each consumer computing 64 x BN/2 (a quarter
    # of a full tile's MMAs), scheduled after every full tile; more are one full tile shifted up.
    tail = 0 < rest <= TAIL_ROWS and BN == 128
    n_m = n_mf + (1 if rest and not tail else 0)
    full_tiles = n_m * n_n
    tiles = full_tiles + (n_n if tail else 0)
    ks = K // TK
    G = min(num_ctas or _device_sms(), tiles)
    if b is None:
        b = jnp.zeros((N,), x.dtype)
    a_tr = _tile_transforms(TK, x.dtype)
    b_tr = _tile_transforms(BN, w.dtype)
    o_tr = _tile_transforms(EC, x.dtype)

    def tile_origin(t):  # tile t -> (first row, first column); M fastest, last row tile shifted up
        m = lax.rem(t, n_m)
        n = lax.div(t, n_m)
        row = jnp.minimum(m * BLOCK_M, M - BLOCK_M)
        col = n * BN
        if not tail:
            return row, col
        is_tail = t >= full_tiles
        return jnp.where(is_tail, M - TAIL_ROWS, row), jnp.where(is_tail, (t - full_tiles) * BN, col)

    def body(x_ref, w_ref, b_ref, o_ref, a_buf, b_buf, o_smem, full_bar, empty_bar):
        cta = lax.axis_index("cta")
        wg = lax.axis_index("wg")
        mine = lax.div(tiles - cta + G - 1, G)  # tiles cta, cta + G, ...
        total = mine * ks

        if not interpret:  # always release (the consumers' increase waits for it)
            pl.when(wg == CONSUMERS)(functools.partial(plgpu.set_max_registers, REGISTERS[1], action="decrease"))

        @pl.when(wg == CONSUMERS)
        def _producer():
            @pl.loop(0, total)
            def _issue(s):
                slot = lax.rem(s, stages)
                pl.when(s >= stages)(lambda: plgpu.barrier_wait(empty_bar.at[slot]))
                t = cta + lax.div(s, ks) * G
                row, col = tile_origin(t)
                k = lax.rem(s, ks) * TK

                def full_rows():
                    for h in range(CONSUMERS):
                        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(row + h * WG_ROWS, WG_ROWS), pl.ds(k, TK)],
                                                a_buf.at[slot, h], full_bar.at[slot])

                def tail_rows():  # two copies of 32 rows (the barrier counts three copies per step)
                    for h in range(CONSUMERS):
                        half = TAIL_ROWS // CONSUMERS
                        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(row + h * half, half), pl.ds(k, TK)],
                                                a_buf.at[slot, 0, pl.ds(h * half, half)], full_bar.at[slot])

                if tail:
                    pl.when(t < full_tiles)(full_rows)
                    pl.when(t >= full_tiles)(tail_rows)
                else:
                    full_rows()
                plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(k, TK), pl.ds(col, BN)], b_buf.at[slot], full_bar.at[slot])

            # Observe the consumers' last releases too (a waiter waits on every phase in order).
            @pl.loop(jnp.maximum(total - stages, 0), total)
            def _drain(s):
                plgpu.barrier_wait(empty_bar.at[lax.rem(s, stages)])

        @pl.when(wg < CONSUMERS)
        def _consumer():
            if not interpret:
                plgpu.set_max_registers(REGISTERS[0], action="increase")

            def mainloop(i, a_view, b_view, shape):
                def acc_scope(acc):
                    @pl.loop(0, ks)
                    def _k(k):
                        s = i * ks + k
                        slot = lax.rem(s, stages)
                        plgpu.barrier_wait(full_bar.at[slot])
                        plgpu.wgmma(acc, a_view(slot), b_view(slot))
                        plgpu.wgmma_wait(1)  # step s-1's MMA is done: its slot may be refilled

                        @pl.when(k > 0)
                        def _release():
                            plgpu.barrier_arrive(empty_bar.at[lax.rem(s - 1 + stages, stages)])

                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(empty_bar.at[lax.rem(i * ks + ks - 1, stages)])
                    return acc[...]

                return pl.run_scoped(acc_scope, plgpu.ACC(shape, jnp.float32))

            def epilogue(v, row0, col0):  # v: [R, C] f32 accumulators of rows row0.., columns col0..
                R, C = v.shape
                bias = plgpu.load(b_ref.at[pl.ds(col0, C)], layout=plgpu.Layout.WGMMA.reduce(0),
                                  optimized=False).astype(jnp.float32)
                h = (v + lax.broadcast_in_dim(bias, (R, C), [1])).astype(x.dtype).astype(jnp.float32)
                y = gelu_tanh_f32(h).astype(x.dtype)
                # Before writing buffer ob, its last store must have read it: with two buffers and
                # two chunks per full tile the last store in flight is the other buffer's (a CTA's
                # full tiles all come before its tail tiles); a one-chunk epilogue (tail tiles,
                # BN = 64) always reuses buffer 0, so it waits for every store.
                chunks = C // EC
                for j, c in enumerate(range(0, C, EC)):
                    ob = j % n_ob
                    plgpu.wait_smem_to_gmem(n_ob - 1 if chunks > 1 else 0, wait_read_only=True)
                    dst = o_smem.at[wg, ob] if R == WG_ROWS else o_smem.at[wg, ob, pl.ds(0, R)]
                    dst[...] = y[:, c:c + EC] if C > EC else y
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(dst, o_ref.at[pl.ds(row0, R), pl.ds(col0 + c, EC)])

            @pl.loop(0, mine)
            def _tile(i):
                t = cta + i * G
                row, col = tile_origin(t)

                def full_tile():
                    v = mainloop(i, lambda slot: a_buf.at[slot, wg], lambda slot: b_buf.at[slot], (WG_ROWS, BN))
                    epilogue(v, row + wg * WG_ROWS, col)

                def tail_tile():  # 64 rows; consumer wg takes columns [wg * BN/2, (wg + 1) * BN/2)
                    cols = BN // CONSUMERS
                    v = mainloop(i, lambda slot: a_buf.at[slot, 0, pl.ds(0, TAIL_ROWS)],
                                 lambda slot: b_buf.at[slot, :, pl.ds(wg * cols, cols)], (TAIL_ROWS, cols))
                    epilogue(v, row, col + wg * cols)

                if tail:
                    pl.when(t < full_tiles)(full_tile)
                    pl.when(t >= full_tiles)(tail_tile)
                else:
                    full_tile()

            plgpu.wait_smem_to_gmem(0)

    kern = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((M, N), x.dtype),
        grid=(G,),
        grid_names=("cta",),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        kernel_name="kestrel_linear_gelu",
        scratch_types=[
            plgpu.SMEM((stages, CONSUMERS, WG_ROWS, TK), x.dtype, transforms=a_tr),
            plgpu.SMEM((stages, TK, BN), w.dtype, transforms=b_tr),
            plgpu.SMEM((CONSUMERS, n_ob, WG_ROWS, EC), x.dtype, transforms=o_tr),
            plgpu.Barrier(num_arrivals=CONSUMERS + 1, num_barriers=stages),
            plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
        ],
        compiler_params=plgpu.CompilerParams(approx_math=True),
        # interpreted: output and scratch start as NaN, so an element the kernel never writes shows
        interpret=(mgpu_interpret.params(detect_races=detect_races, uninitialized_memory="nan")
                   if interpret else None),
    )
    return kern(x, w, b)
