"""From the fused QKV product to attention's inputs: tau scaling, partial rotary, the KV write.

Per layer the decoder turns u = LN(x) @ W_qkv + b ([T, (H + 2 Hkv) * Dh]) into
  * MD3 only, tau (MOONDREAM.md §3.3.2): g = GELU_erf(u); tau_q = tanh(g . wq[h]) + p(pos),
    tau_v = tanh(g . wv[h]) + p(pos), p = 0.5 + sigmoid(alpha[h] ln(pos + 1)); q *= tau_q, v *= tau_v
  * rotary on the first `rotary_dim` channels of q and k (half-split pairs, float32 math)
  * the new K and V rows written to their KV-pool slots (FP8 pools: v / scale, clamped to +-448)

`qkv_heads_ref` is that math in jnp (the model's path everywhere but decode on a GPU, and the
reference of the kernel); `decode_qkv_kernel` is all of it, KV write included, as one Pallas Triton
launch for decode-size batches, and `prefill_qkv_kernel` the same for a prefill or mixed step's
rows (one program per row, all heads; tau's factors from XLA), replacing XLA's two rotary
concatenations, the q slice of a mixed step and the KV write kernel (H200, thirty-fourth session:
MD2's mixed step -1.6%, prefill step -2.9%, MD3's prefill step -2.5%, bit-identical). Why the
decode kernel: at batch 1 XLA runs it as six kernels per layer (GELU, the two tau dots, v * tau,
rotary of q, rotary of k) plus the KV write kernel, each 1.3-2.4 us of mostly launch and tail on an
H100 (sixth session trace, ~10 us per layer, 24 layers per token).

Kernel: grid (rows M, query heads H); program (m, h) computes its head of q, and for h < Hkv its
head of k and v and writes both rows to the pool. With `route` (an MoE layer's router logits from
the same decode GEMM launch, `decode_qkv_route_kernel`) the grid has one more column and program
(0, H) builds the dense regime's routing tables (`moe_route_triton`'s program) beside the heads,
saving that program's launch. With `TauDots` (the MoE layers' decode QKV GEMM formed the tau
dot products, per column block: `gemv_mgpu.gemv_rows`' tau_w) each program only sums its head's
two columns of block shares. Otherwise, with tau, each program reads the whole row u[m] and its
heads' tau weights (wq[h], wv[h]) to form the two dot products itself: M * H programs each read
~3 * N * 2 bytes from L2, fine for decode rows (the model uses it up to `MAX_TAU_ROWS`),
wasteful for prefill. Numerics follow the jnp path's roundings: GELU output,
tau dot, tau and the tau products in bf16, rotary in float32 rounded to bf16, FP8 quantisation by
an IEEE divide then a clamp. GELU uses erf from Abramowitz-Stegun 7.1.26 (|error| <= 1.5e-7,
below bf16 resolution), since Pallas Triton has no erf.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kestrel_jax.models.layers import apply_rope, gelu_erf, rope_cos_sin, rope_inv_freq, tau_position_term
from kestrel_jax.pallas import moe_route_triton
from kestrel_jax.pallas.moe import gelu_erf_poly
from kestrel_jax.pallas.moe_route_mgpu import DenseRoute
from kestrel_jax.pallas.paged_attention import FP8_MAX, check_pool, is_fp8, write_kv_ref

# Decode rows up to which the model has the kernel form tau from the tau weights (each program a
# GELU over its whole row); past them XLA forms the factors. With the QKV GEMM's tau dots: any rows.
MAX_TAU_ROWS = 8
# Warps per program. H100, sixth session (tools/bench_qkv_epilogue.py, 24 cold layers, us per
# layer at 1 / 8 rows): with tau 4 warps 8.25 / 8.75, 8 warps 6.29 / 7.02, 16 warps 4.60 / 6.12
# (the jnp path: 7.77 / 11.05); without tau 4 warps 1.77 / 1.91, 16 warps 1.87 / 2.25 (jnp 2.74 /
# 5.17). Each tau program forms GELU(u) over the whole row and two dot products with it.
TAU_WARPS, PLAIN_WARPS = 16, 4
# Warps per program of the prefill kernel (one row, all heads). H200, thirty-fourth session
# (`bench_qkv_epilogue.py --prefill`, us per layer, MD2 / MD3 at 1,600 rows): 2 warps 26.83 / 57.17,
# 4 warps 25.71 / 53.69, 8 warps 25.02 / 53.14 (1,536 rows: 8 warps also fastest).
PREFILL_WARPS = 8


class TauWeights(NamedTuple):
    """MD3 tau scaling: per-head weights over the whole QKV row and the position slope."""

    wq: jax.Array  # [H, N]
    wv: jax.Array  # [H, N]
    alpha: jax.Array  # [H]


class TauDots(NamedTuple):
    """MD3's tau dot products formed by the QKV GEMM (`gemv_mgpu.gemv_rows(tau_w=...)`): their
    per-column-block shares, summed here, and the position slope."""

    dots: jax.Array  # [blocks, 2 H, >= M] f32: rows h < H are g . wq[h], rows H + h are g . wv[h]
    alpha: jax.Array  # [H]


def split_heads(u: jax.Array, n_heads: int, n_kv_heads: int, head_dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    t = u.shape[0]
    hq, hk = n_heads * head_dim, n_kv_heads * head_dim
    return (u[:, :hq].reshape(t, n_heads, head_dim), u[:, hq:hq + hk].reshape(t, n_kv_heads, head_dim),
            u[:, hq + hk:].reshape(t, n_kv_heads, head_dim))


def tau_factors(u: jax.Array, positions: jax.Array, tau: TauWeights,
                gelu: Callable[[jax.Array], jax.Array] = gelu_erf) -> tuple[jax.Array, jax.Array, jax.Array]:
    """MD3's tau factors of each row and head: (tau_q, tau_v, the position term), f32 [T, H]."""
    g = gelu(u)
    tok_q = jnp.tanh(jnp.dot(g, tau.wq.astype(u.dtype).T).astype(jnp.float32))
    tok_v = jnp.tanh(jnp.dot(g, tau.wv.astype(u.dtype).T).astype(jnp.float32))
    pos = tau_position_term(positions, tau.alpha)
    return tok_q + pos, tok_v + pos, pos


def qkv_heads_ref(
    u: jax.Array,  # [T, (H + 2 Hkv) * Dh] fused QKV product (bias included)
    positions: jax.Array,  # [T] int32
    tau: TauWeights | None,
    *,
    n_heads: int,
    n_kv_heads: int,
    rotary_dim: int,
    theta: float,
    aux: dict[str, jax.Array] | None = None,  # filled with tau_q, tau_v, tau_pos (f32 [T, H]) when tau
    gelu: Callable[[jax.Array], jax.Array] = gelu_erf,  # tau's GELU (`ops.tau_gelu`: an A/B switch)
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """-> q [T, H, Dh], k [T, Hkv, Dh] (post-rotary), v [T, Hkv, Dh] (post-tau), all u.dtype."""
    head_dim = u.shape[1] // (n_heads + 2 * n_kv_heads)
    q, k, v = split_heads(u, n_heads, n_kv_heads, head_dim)
    if tau is not None:
        tau_q, tau_v, pos = tau_factors(u, positions, tau, gelu)
        q = q * tau_q[:, :, None].astype(q.dtype)
        v = v * tau_v[:, :, None].astype(v.dtype)
        if aux is not None:
            aux.update(tau_q=tau_q, tau_v=tau_v, tau_pos=pos)
    cos, sin = rope_cos_sin(positions, rotary_dim, theta)
    return apply_rope(q, cos, sin, rotary_dim), apply_rope(k, cos, sin, rotary_dim), v


def decode_qkv_ref(
    u: jax.Array, positions: jax.Array, slots: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
    k_scale: jax.Array, v_scale: jax.Array, tau: TauWeights | None, *, n_heads: int, rotary_dim: int, theta: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Reference of `decode_qkv_kernel` (same arguments): -> (q, k_pages, v_pages)."""
    q, k, v = qkv_heads_ref(u, positions, tau, n_heads=n_heads, n_kv_heads=k_pages.shape[1],
                            rotary_dim=rotary_dim, theta=theta)
    kp, vp = write_kv_ref(k_pages, v_pages, k, v, slots, k_scale, v_scale)
    return q, kp, vp


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _pow2_spans(n: int) -> list[tuple[int, int]]:
    """[0, n) as consecutive power-of-two spans, largest first (Triton blocks are powers of two)."""
    spans, c0 = [], 0
    for bit in reversed(range(n.bit_length())):
        if n >> bit & 1:
            spans.append((c0, 1 << bit))
            c0 += 1 << bit
    return spans


def _chunk(n: int) -> int:
    """Largest power of two <= 2048 dividing n (the tau dots' tile)."""
    c = 2048
    while c > 1 and n % c:
        c //= 2
    return c


def decode_qkv_problem(u: jax.Array, k_pages: jax.Array, tau: TauWeights | None, *, n_heads: int,
                       rotary_dim: int, factors: tuple[jax.Array, jax.Array] | None = None,
                       tau_dots: TauDots | None = None, u_cols: int | None = None) -> str | None:
    """Why `decode_qkv_kernel` cannot take these shapes (None: it can). `u_cols`: u is wider, its
    first `u_cols` columns being the QKV product (tau, where asked for, over those columns only)."""
    if u_cols is not None and (u.ndim != 2 or not 0 < u_cols <= u.shape[1]):
        return f"u_cols {u_cols} must be in (0, u's width] for u {u.shape}"
    if tau_dots is not None:
        if tau is not None or factors is not None:
            return "tau dots, tau weights and tau factors are exclusive"
        d = tau_dots.dots
        if d.ndim != 3 or d.shape[1] != 2 * n_heads or d.shape[2] < u.shape[0] or d.dtype != jnp.float32:
            return f"tau dots {d.shape} {d.dtype} must be f32 [blocks, 2 x heads {n_heads}, >= rows {u.shape[0]}]"
        if tau_dots.alpha.shape != (n_heads,):
            return f"tau alpha {tau_dots.alpha.shape} must be [{n_heads}]"
        if k_pages.ndim == 4 and k_pages.shape[1] != n_heads:
            return f"tau needs as many KV heads as query heads, got {k_pages.shape[1]} and {n_heads}"
    if factors is not None:
        if tau is not None:
            return "tau weights and precomputed tau factors are exclusive"
        if any(f.shape != (u.shape[0], n_heads) for f in factors):
            return f"tau factors {[f.shape for f in factors]} must be [rows {u.shape[0]}, heads {n_heads}]"
        if k_pages.ndim == 4 and k_pages.shape[1] != n_heads:
            return f"tau needs as many KV heads as query heads, got {k_pages.shape[1]} and {n_heads}"
    if u.ndim != 2 or k_pages.ndim != 4:
        return f"u must be [M, N] and the pool [P, Hkv, S, Dh], got {u.shape} and {k_pages.shape}"
    P, hkv, S, dh = k_pages.shape
    width = u.shape[1] if u_cols is None else u_cols
    if width != (n_heads + 2 * hkv) * dh or n_heads % hkv:
        return f"u width {width} is not (H {n_heads} + 2 Hkv {hkv}) x Dh {dh}"
    half, rest = rotary_dim // 2, dh - rotary_dim
    if rotary_dim % 2 or not _pow2(half) or not (rest == 0 or _pow2(rest)):
        return f"rotary_dim {rotary_dim} / 2 and head_dim - rotary_dim {rest} must be powers of two (or 0)"
    if jnp.dtype(u.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return f"u must be bf16 or f32, got {u.dtype}"
    if not (is_fp8(k_pages.dtype) or jnp.dtype(k_pages.dtype) == jnp.dtype(jnp.bfloat16)):
        return f"pool dtype must be float8_e4m3fn or bf16, got {k_pages.dtype}"
    if k_pages.size >= 2**31:
        return f"pool of {k_pages.size} elements: the kernel's offsets are int32"
    if tau is not None and (tau.wq.shape != (n_heads, width) or tau.wv.shape != tau.wq.shape
                            or tau.alpha.shape != (n_heads,) or _chunk(width) < 16):
        return f"tau weights {tau.wq.shape} / {tau.wv.shape} / {tau.alpha.shape} do not fit u {u.shape}"
    if tau is not None and hkv != n_heads:  # v's tau is per query head (MD3 has no GQA)
        return f"tau needs as many KV heads as query heads, got {hkv} and {n_heads}"
    return None


def _bf16(x: jax.Array) -> jax.Array:
    """Round float32 to bf16 and back (the jnp path's bf16 intermediates)."""
    return x.astype(jnp.bfloat16).astype(jnp.float32)


def _kernel(u_ref, pos_ref, slot_ref, ks_ref, vs_ref, inv_ref, *refs, n_heads: int, n_kv: int, dh: int, rot: int,
            has_tau: bool, has_factors: bool, has_dots: bool, chunk: int, fp8: bool, low: bool,
            route: tuple[int, int] | None, cols: int):
    # program ids are read here, outside any branch (the interpreter evaluates them only there)
    m, h = pl.program_id(0), pl.program_id(1)
    mode = dict(has_tau=has_tau, has_factors=has_factors, has_dots=has_dots)
    if route is None:
        _heads(m, h, u_ref, pos_ref, slot_ref, ks_ref, vs_ref, inv_ref, *refs, n_heads=n_heads, n_kv=n_kv, dh=dh,
               rot=rot, chunk=chunk, fp8=fp8, low=low, cols=cols, **mode)
        return
    # [..., logits, n_valid, (the pools), q, pools, weights, experts, dest, meta_up, meta_down]
    n_tau = 3 if has_tau else (2 if has_factors or has_dots else 0)
    logits_ref, nv_ref = refs[n_tau], refs[n_tau + 1]
    head_refs = refs[:n_tau] + refs[n_tau + 2:n_tau + 7]
    route_out = refs[n_tau + 7:]

    @pl.when(h < n_heads)
    def _head_program():
        _heads(m, h, u_ref, pos_ref, slot_ref, ks_ref, vs_ref, inv_ref, *head_refs, n_heads=n_heads, n_kv=n_kv, dh=dh,
               rot=rot, chunk=chunk, fp8=fp8, low=low, cols=cols, **mode)

    @pl.when((h == n_heads) & (m == 0))
    def _route_program():
        moe_route_triton.tables_program(logits_ref, nv_ref, *route_out, top_k=route[0], nt=route[1])


def _heads(m, h, u_ref, pos_ref, slot_ref, ks_ref, vs_ref, inv_ref, *refs, n_heads: int, n_kv: int, dh: int,
           rot: int, has_tau: bool, has_factors: bool, has_dots: bool, chunk: int, fp8: bool, low: bool,
           cols: int):
    tq_ref = tv_ref = dots_ref = None
    if has_tau:
        wq_ref, wv_ref, alpha_ref, _kp_in, _vp_in, q_ref, kp_ref, vp_ref = refs
    elif has_dots:
        dots_ref, alpha_ref, _kp_in, _vp_in, q_ref, kp_ref, vp_ref = refs
    elif has_factors:
        tq_ref, tv_ref, _kp_in, _vp_in, q_ref, kp_ref, vp_ref = refs
    else:
        _kp_in, _vp_in, q_ref, kp_ref, vp_ref = refs
    f32 = jnp.float32
    n = cols  # the QKV product's columns (u may be wider: `u_cols`)
    P, _, S, _ = kp_ref.shape
    half, rest_w = rot // 2, dh - rot
    pos = pos_ref[m]
    slot = slot_ref[m]
    ang = pos.astype(f32) * inv_ref[...]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    rnd = _bf16 if low else (lambda x: x)  # bf16 u: round where the jnp path holds bf16

    def head(col):  # (first rotary half, second rotary half, pass-through channels) of one head
        a = u_ref[m, pl.ds(col, half)].astype(f32)
        b = u_ref[m, pl.ds(col + half, half)].astype(f32)
        c = u_ref[m, pl.ds(col + rot, rest_w)].astype(f32) if rest_w else None
        return a, b, c

    def scaled(parts, t):  # x * tau in u.dtype
        return tuple(None if p is None else rnd(p * t) for p in parts)

    def rotated(parts):
        a, b, c = parts
        return rnd(a * cos - b * sin), rnd(a * sin + b * cos), c

    # Every load is issued before any arithmetic waits on one (straight-line code: the tau tiles
    # and the three heads are in flight together), and the K/V loads do not wait for the branch:
    # programs with h >= Hkv read head Hkv - 1 and discard it.
    hk = jnp.minimum(h, n_kv - 1)
    qh, kh, vh = head(h * dh), head((n_heads + hk) * dh), head((n_heads + n_kv + hk) * dh)
    if has_tau or dots_ref is not None:
        if dots_ref is not None:  # the GEMM's per-block shares of the two dots: sum them
            spans = _pow2_spans(dots_ref.shape[0])
            parts_q = [dots_ref[pl.ds(c0, c), h, m] for c0, c in spans]
            parts_v = [dots_ref[pl.ds(c0, c), n_heads + h, m] for c0, c in spans]
            alpha = alpha_ref[h].astype(f32)
            dot_q = functools.reduce(jnp.add, [jnp.sum(t) for t in parts_q])
            dot_v = functools.reduce(jnp.add, [jnp.sum(t) for t in parts_v])
        else:
            tiles = [(u_ref[m, pl.ds(c0, chunk)], wq_ref[h, pl.ds(c0, chunk)], wv_ref[h, pl.ds(c0, chunk)])
                     for c0 in range(0, n, chunk)]
            alpha = alpha_ref[h].astype(f32)
            acc_q = jnp.zeros((chunk,), f32)
            acc_v = jnp.zeros((chunk,), f32)
            for ut, wqt, wvt in tiles:
                g = rnd(gelu_erf_poly(ut.astype(f32)))
                acc_q += g * wqt.astype(f32)
                acc_v += g * wvt.astype(f32)
            dot_q, dot_v = jnp.sum(acc_q), jnp.sum(acc_v)
        p = 0.5 + 1.0 / (1.0 + jnp.exp(-(alpha * jnp.log(pos.astype(f32) + 1.0))))
        tau_q = rnd(jnp.tanh(rnd(dot_q)) + p)
        tau_v = rnd(jnp.tanh(rnd(dot_v)) + p)
        qh, vh = scaled(qh, tau_q), scaled(vh, tau_v)
    elif tq_ref is not None and tv_ref is not None:  # the factors in u.dtype, formed outside
        qh, vh = scaled(qh, tq_ref[m, h].astype(f32)), scaled(vh, tv_ref[m, hk].astype(f32))

    for off, width, x in zip((0, half, rot), (half, half, rest_w), rotated(qh), strict=True):
        if width:
            q_ref[m, h, pl.ds(off, width)] = x.astype(q_ref.dtype)
    k_new = rotated(kh)

    @pl.when((h < n_kv) & (slot >= 0))
    def _write():
        page = jnp.minimum(slot // S, P - 1)
        row = slot % S
        for ref, parts, sc_ref in ((kp_ref, k_new, ks_ref), (vp_ref, vh, vs_ref)):
            for off, width, x in zip((0, half, rot), (half, half, rest_w), parts, strict=True):
                if not width:
                    continue
                if fp8:  # IEEE divide then clamp, as quantize_kv
                    x = jnp.minimum(jnp.maximum(rnd(x) / sc_ref[0], -FP8_MAX), FP8_MAX)
                ref[page, h, row, pl.ds(off, width)] = x.astype(ref.dtype)


@functools.partial(jax.jit, static_argnames=("n_heads", "rotary_dim", "theta", "interpret", "num_warps", "u_cols"))
def decode_qkv_kernel(
    u: jax.Array,  # [>= M, (H + 2 Hkv) * Dh] bf16 / f32 fused QKV product (bias included); rows >= M unread
    positions: jax.Array,  # [M] int32
    slots: jax.Array,  # [M] int32 flat KV slot; < 0 = padding row (q computed, nothing written)
    k_pages: jax.Array,  # [P, Hkv, S, Dh] float8_e4m3fn / bf16
    v_pages: jax.Array,
    k_scale: jax.Array,  # [] f32
    v_scale: jax.Array,
    tau: TauWeights | None = None,
    *,
    n_heads: int,
    rotary_dim: int,
    theta: float,
    factors: tuple[jax.Array, jax.Array] | None = None,  # (tau_q, tau_v) [M, H] in u.dtype, instead of tau
    tau_dots: TauDots | None = None,  # the tau dots from the QKV GEMM, instead of tau
    interpret: bool = False,
    num_warps: int | None = None,  # None: TAU_WARPS with tau, else PLAIN_WARPS
    u_cols: int | None = None,  # u wider than the QKV product: its first u_cols columns are it
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """-> (q [M, H, Dh] in u.dtype, k_pages, v_pages with the M new rows written). With `factors`
    the kernel scales q and v by tau factors formed outside (`tau_factors`, rounded to u.dtype)
    instead of forming them from `tau` itself (for batches past `MAX_TAU_ROWS`); with `tau_dots`
    it forms the factors from the dot products the QKV GEMM formed (`gemv_mgpu.gemv_rows`'
    tau_w) instead of from the whole row and the tau weights. With `u_cols` u may carry more
    columns past the QKV product (a dense layer's joined QKV + fc1 product): they are not read
    (tau's GELU and dots run over the first `u_cols` columns)."""
    q, kp, vp, _ = _decode_qkv(u, positions, slots, k_pages, v_pages, k_scale, v_scale, tau, n_heads=n_heads,
                               rotary_dim=rotary_dim, theta=theta, factors=factors, tau_dots=tau_dots,
                               interpret=interpret, num_warps=num_warps, u_cols=u_cols)
    return q, kp, vp


def _default_warps(tau: bool, route: bool) -> int:
    """TAU_WARPS where programs form tau from the whole row; else PLAIN_WARPS, or the routing
    program's own default where the launch also routes (its one program is the long one)."""
    if tau:
        return TAU_WARPS
    return moe_route_triton.DEFAULT_WARPS if route else PLAIN_WARPS


def decode_qkv_route_supported(logits: jax.Array, top_k: int) -> bool:
    """Whether `decode_qkv_route_kernel` takes these [Nt, E] router logits (`moe_route_triton`'s limits)."""
    return logits.ndim == 2 and moe_route_triton.route_tables_supported(logits.shape[0], logits.shape[1], top_k)


@functools.partial(jax.jit, static_argnames=("n_heads", "rotary_dim", "theta", "top_k", "block_tokens", "interpret",
                                             "num_warps"))
def decode_qkv_route_kernel(
    u: jax.Array,
    positions: jax.Array,
    slots: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    k_scale: jax.Array,
    v_scale: jax.Array,
    tau: TauWeights | None,
    logits: jax.Array,  # [Nt, E] router logits (f32 or bf16), rows >= num_valid ignored
    num_valid: jax.Array,  # [1] int32
    *,
    n_heads: int,
    rotary_dim: int,
    theta: float,
    top_k: int,
    block_tokens: int,
    factors: tuple[jax.Array, jax.Array] | None = None,
    tau_dots: TauDots | None = None,
    interpret: bool = False,
    num_warps: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, DenseRoute]:
    """`decode_qkv_kernel` and `moe_route_triton.route_tables(logits, num_valid, top_k=top_k,
    block_tokens=block_tokens)` in one launch: -> (q, k_pages, v_pages, the routing tables)."""
    if not decode_qkv_route_supported(logits, top_k):
        raise ValueError(f"decode_qkv_route_kernel: unsupported logits {logits.shape} with top_k {top_k}")
    q, kp, vp, route = _decode_qkv(u, positions, slots, k_pages, v_pages, k_scale, v_scale, tau, n_heads=n_heads,
                                   rotary_dim=rotary_dim, theta=theta, factors=factors, tau_dots=tau_dots,
                                   interpret=interpret, num_warps=num_warps,
                                   route=(logits, num_valid, top_k, block_tokens))
    assert route is not None
    return q, kp, vp, route


def _decode_qkv(u: jax.Array, positions: jax.Array, slots: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                k_scale: jax.Array, v_scale: jax.Array, tau: TauWeights | None, *, n_heads: int, rotary_dim: int,
                theta: float, factors: tuple[jax.Array, jax.Array] | None, interpret: bool, num_warps: int | None,
                route: tuple[jax.Array, jax.Array, int, int] | None = None,  # (logits, n_valid, top_k, Nt)
                tau_dots: TauDots | None = None, u_cols: int | None = None,
                ) -> tuple[jax.Array, jax.Array, jax.Array, DenseRoute | None]:
    """The two public kernels' body (arguments as `decode_qkv_kernel`'s and `decode_qkv_route_kernel`'s)."""
    check_pool(k_pages, v_pages)
    problem = decode_qkv_problem(u, k_pages, tau, n_heads=n_heads, rotary_dim=rotary_dim, factors=factors,
                                 tau_dots=tau_dots, u_cols=u_cols)
    if problem is not None:
        raise ValueError(f"decode_qkv_kernel: {problem}")
    # u may have padding rows past the M decode rows, and columns past the QKV product's N (`u_cols`)
    M, N = positions.shape[0], u.shape[1] if u_cols is None else u_cols
    if u.shape[0] < M or slots.shape != positions.shape:
        raise ValueError(f"decode_qkv_kernel: u has {u.shape[0]} rows, positions {positions.shape}, "
                         f"slots {slots.shape}: need [M] positions and slots and at least M rows of u")
    _, n_kv, _, dh = k_pages.shape
    inv = jnp.asarray(rope_inv_freq(rotary_dim, theta))
    scales = [jnp.asarray(s, jnp.float32).reshape(1) for s in (k_scale, v_scale)]
    tau_args = [tau.wq, tau.wv, tau.alpha] if tau is not None else []
    if factors is not None:
        tau_args = [f.astype(u.dtype) for f in factors]
    if tau_dots is not None:
        tau_args = [tau_dots.dots, tau_dots.alpha]
    route_ins: list[jax.Array] = []
    route_shapes: list[jax.ShapeDtypeStruct] = []
    if route is not None:  # the routing tables' inputs and outputs, as `route_tables` forms them
        route_ins, route_shapes = moe_route_triton.tables_io(route[0], route[1], route[2])
    ins = [u, positions.astype(jnp.int32), slots.astype(jnp.int32), *scales, inv, *tau_args, *route_ins, k_pages,
           v_pages]
    kern = functools.partial(
        _kernel, n_heads=n_heads, n_kv=n_kv, dh=dh, rot=rotary_dim, has_tau=tau is not None,
        has_factors=factors is not None, has_dots=tau_dots is not None, chunk=_chunk(N), fp8=is_fp8(k_pages.dtype),
        low=jnp.dtype(u.dtype) == jnp.dtype(jnp.bfloat16), route=None if route is None else (route[2], route[3]),
        cols=N)
    q, kp, vp, *tables = pl.pallas_call(
        kern,
        out_shape=(jax.ShapeDtypeStruct((M, n_heads, dh), u.dtype),
                   jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype), *route_shapes),
        grid=(M, n_heads + (1 if route is not None else 0)),
        input_output_aliases={len(ins) - 2: 1, len(ins) - 1: 2},
        compiler_params=pltriton.CompilerParams(
            num_warps=num_warps or _default_warps(tau is not None, route is not None), num_stages=1),
        interpret=interpret,
        name="kestrel_decode_qkv",
    )(*ins)
    return q, kp, vp, (DenseRoute(*tables) if route is not None else None)


# ------------------------------------------------------------------------------------- prefill


def prefill_qkv_problem(u: jax.Array, k_pages: jax.Array, *, n_heads: int, rotary_dim: int,
                        factors: tuple[jax.Array, jax.Array] | None = None) -> str | None:
    """Why `prefill_qkv_kernel` cannot take these shapes (None: it can): `decode_qkv_problem`'s
    limits, and head counts that are powers of two (a program's blocks span all heads)."""
    problem = decode_qkv_problem(u, k_pages, None, n_heads=n_heads, rotary_dim=rotary_dim, factors=factors)
    if problem is not None:
        return problem
    if not (_pow2(n_heads) and _pow2(k_pages.shape[1])):
        return f"head counts {n_heads} / {k_pages.shape[1]} must be powers of two (Triton blocks)"
    if not _pow2(k_pages.shape[3]):  # v is one [Hkv, Dh] block
        return f"head_dim {k_pages.shape[3]} must be a power of two (Triton blocks)"
    return None


def _prefill_kernel(u_ref, pos_ref, slot_ref, ks_ref, vs_ref, inv_ref, *refs, n_heads: int, n_kv: int, rot: int,
                    has_factors: bool, fp8: bool, low: bool, split: int):
    m = pl.program_id(0)  # read outside any branch (the interpreter's rule)
    f32 = jnp.float32
    tq_ref, tv_ref = refs[:2] if has_factors else (None, None)
    outs = refs[4:] if has_factors else refs[2:]  # past the factors and the aliased input pools
    q_refs, (kp_ref, vp_ref) = outs[:-2], outs[-2:]
    dh = u_ref.shape[2]
    P, _, S, _ = kp_ref.shape
    half, rest_w = rot // 2, dh - rot
    pos = pos_ref[m]
    slot = slot_ref[m]
    ang = pos.astype(f32) * inv_ref[...]
    cos, sin = jnp.cos(ang)[None, :], jnp.sin(ang)[None, :]
    rnd = _bf16 if low else (lambda x: x)

    def heads(h0, n):  # the [n, channels] blocks of heads h0..h0+n: rotary halves, pass-through
        a = u_ref[m, pl.ds(h0, n), pl.ds(0, half)].astype(f32)
        b = u_ref[m, pl.ds(h0, n), pl.ds(half, half)].astype(f32)
        c = u_ref[m, pl.ds(h0, n), pl.ds(rot, rest_w)].astype(f32) if rest_w else None
        return a, b, c

    def rotated(parts):
        a, b, c = parts
        return rnd(a * cos - b * sin), rnd(a * sin + b * cos), c

    # all loads first (straight-line code: in flight together), then the arithmetic
    qh, kh = heads(0, n_heads), heads(n_heads, n_kv)
    vh = u_ref[m, pl.ds(n_heads + n_kv, n_kv), :].astype(f32)
    if tq_ref is not None and tv_ref is not None:  # tau factors in u.dtype, formed outside
        tq = tq_ref[m, :].astype(f32)[:, None]
        tv = tv_ref[m, pl.ds(0, n_kv)].astype(f32)[:, None]
        qh = tuple(None if p is None else rnd(p * tq) for p in qh)
        vh = rnd(vh * tv)
    q_parts = [(off, x) for off, x in zip((0, half, rot), rotated(qh), strict=True) if x is not None]
    k_parts = [(off, x) for off, x in zip((0, half, rot), rotated(kh), strict=True) if x is not None]

    def put_q(ref, row):
        for off, x in q_parts:
            ref[row, :, pl.ds(off, x.shape[1])] = x.astype(ref.dtype)

    if split == 0:
        put_q(q_refs[0], m)
    else:
        @pl.when(m < split)
        def _decode_row():
            put_q(q_refs[0], m)

        @pl.when(m >= split)
        def _prefill_row():
            put_q(q_refs[1], m - split)

    @pl.when(slot >= 0)
    def _write():
        page = jnp.minimum(slot // S, P - 1)
        row = slot % S
        for ref, parts, sc_ref in ((kp_ref, k_parts, ks_ref), (vp_ref, [(0, vh)], vs_ref)):
            for off, x in parts:
                if fp8:  # IEEE divide then clamp, as quantize_kv
                    x = jnp.minimum(jnp.maximum(rnd(x) / sc_ref[0], -FP8_MAX), FP8_MAX)
                ref[page, :, row, pl.ds(off, x.shape[1])] = x.astype(ref.dtype)


@functools.partial(jax.jit, static_argnames=("n_heads", "rotary_dim", "theta", "split", "interpret", "num_warps"))
def prefill_qkv_kernel(
    u: jax.Array,  # [>= M, (H + 2 Hkv) * Dh] bf16 / f32 fused QKV product (bias included); rows >= M unread
    positions: jax.Array,  # [M] int32
    slots: jax.Array,  # [M] int32 flat KV slot; < 0 = padding row (q computed, nothing written)
    k_pages: jax.Array,  # [P, Hkv, S, Dh] float8_e4m3fn / bf16
    v_pages: jax.Array,
    k_scale: jax.Array,  # [] f32
    v_scale: jax.Array,
    *,
    n_heads: int,
    rotary_dim: int,
    theta: float,
    factors: tuple[jax.Array, jax.Array] | None = None,  # (tau_q, tau_v) [M, H] (`tau_factors`), MD3
    split: int = 0,
    interpret: bool = False,
    num_warps: int = PREFILL_WARPS,
) -> tuple[jax.Array, ...]:
    """Rotary, tau scaling (from `factors`) and the KV write of a prefill or mixed step's rows in
    one launch: one program per row, all heads at once (`decode_qkv_kernel` runs a program per row
    and head, fine for decode rows, ~50k programs for a 1,600-row step). -> (q [M, H, Dh],
    k_pages, v_pages) with `split` = 0; with 0 < split < M, (q of rows [0, split), q of rows
    [split, M), k_pages, v_pages): a mixed step's decode rows and prefill rows, which its two
    attention kernels read, without XLA slicing one q apart. Numerics: `decode_qkv_kernel`'s
    factor mode (the jnp path's roundings)."""
    check_pool(k_pages, v_pages)
    problem = prefill_qkv_problem(u[: positions.shape[0]], k_pages, n_heads=n_heads, rotary_dim=rotary_dim,
                                  factors=factors)
    if problem is not None:
        raise ValueError(f"prefill_qkv_kernel: {problem}")
    M = positions.shape[0]
    if u.shape[0] < M or slots.shape != positions.shape:
        raise ValueError(f"prefill_qkv_kernel: u has {u.shape[0]} rows, positions {positions.shape}, "
                         f"slots {slots.shape}: need [M] positions and slots and at least M rows of u")
    if not 0 <= split < M:
        raise ValueError(f"prefill_qkv_kernel: split {split} must be in [0, rows {M})")
    _, n_kv, _, dh = k_pages.shape
    u3 = u.reshape(u.shape[0], n_heads + 2 * n_kv, dh)
    inv = jnp.asarray(rope_inv_freq(rotary_dim, theta))
    scales = [jnp.asarray(s, jnp.float32).reshape(1) for s in (k_scale, v_scale)]
    tau_args = [f.astype(u.dtype) for f in factors] if factors is not None else []
    ins = [u3, positions.astype(jnp.int32), slots.astype(jnp.int32), *scales, inv, *tau_args, k_pages, v_pages]
    rows = (M,) if split == 0 else (split, M - split)
    q_shapes = [jax.ShapeDtypeStruct((r, n_heads, dh), u.dtype) for r in rows]
    kern = functools.partial(_prefill_kernel, n_heads=n_heads, n_kv=n_kv, rot=rotary_dim,
                             has_factors=factors is not None, fp8=is_fp8(k_pages.dtype),
                             low=jnp.dtype(u.dtype) == jnp.dtype(jnp.bfloat16), split=split)
    nq = len(q_shapes)
    return tuple(pl.pallas_call(
        kern,
        out_shape=(*q_shapes, jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)),
        grid=(M,),
        input_output_aliases={len(ins) - 2: nq, len(ins) - 1: nq + 1},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kestrel_prefill_qkv",
    )(*ins))
