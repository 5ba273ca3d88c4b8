"""A decode step's QKV epilogue and split-KV attention in one Pallas Triton launch (opt-in).

At one decode row a dense layer runs the QKV epilogue (`qkv_epilogue.decode_qkv_kernel`: rotary,
the new K/V row into the pool, q out) and then decode attention (`paged_attention_mgpu`), two
launches whose time is mostly fixed cost: 1.9 + 5.1 us per MD2 layer on an H200 (forty-seventh
session), 24 layers per token. Here program (m, h, s) of grid (rows, heads, splits) forms its
head's q (and k, v) from the QKV product itself, attends over its share of the sequence's cached
pages, and writes split partials that `paged_attention_mgpu.merge_splits` combines (an XLA fusion
that the consumer of attention's output takes in: MD2's output-projection input pad):

  * q, k: rotary on the first `rotary_dim` channels (float32, rounded to the product's dtype as
    the jnp path holds it); v as is. No tau: layers with tau keep the two-launch path.
  * program (m, h, 0) writes row m's new K and V of head h to its slot (FP8 pools: v / scale,
    clamped to +-448, as `quantize_kv`).
  * the cached positions [0, L - 1) (L = kv_lens[m], the new token included) are cut into page
    tiles and shared out over the splits, ceil(tiles / splits) each; every program streams its
    tiles with the next one's page id and K/V loads issued before the current tile's arithmetic.
    Positions >= L - 1 are masked at the load (never read: the new token's slot may be written by
    program 0 meanwhile, and unused rows may hold anything), so split s reads no memory another
    program writes.
  * the last split also takes the new token, from registers: its K and V as the pool stores them
    (quantised and read back), so the scores equal those of attention over the written pool.
  * online softmax in the exp2 domain (q scaled by sm_scale * log2 e); each split writes its
    normalised output and log2-sum-exp2 (an empty split: 0 and -inf), the layout
    `merge_splits` takes.

`decode_qkv_attention_ref` is the same in jnp (`qkv_heads_ref`, `write_kv_ref`,
`decode_attention_ref`), the reference of the tests. The kernel's float sums run in another order
than the reference's: results agree to f32 rounding, the pool writes bit for bit.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kestrel_jax.models.layers import rope_inv_freq
from kestrel_jax.pallas.paged_attention import (
    FP8_MAX,
    check_pool,
    decode_attention_ref,
    is_fp8,
    write_kv_ref,
)
from kestrel_jax.pallas.paged_attention_mgpu import merge_splits
from kestrel_jax.pallas.qkv_epilogue import qkv_heads_ref

LOG2E = math.log2(math.e)
NEG_INF = float("-inf")
DEFAULT_WARPS = 4
# Programs per SM the default split count aims at (rows x heads x splits ~ this x 132).
_TARGET_PROGRAMS = 4 * 132
MAX_SPLITS = 16


def default_splits(rows: int, heads: int, max_tiles: int) -> int:
    """Splits of the cached range: a power of two up to MAX_SPLITS such that rows x heads x splits
    stays near `_TARGET_PROGRAMS`, and at most the table's tiles."""
    s = 1
    while s < MAX_SPLITS and rows * heads * s * 2 <= _TARGET_PROGRAMS and s * 2 <= max(1, max_tiles):
        s *= 2
    return s


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


_Shaped = jax.Array | jax.ShapeDtypeStruct


def qkv_attention_problem(u: _Shaped, k_pages: _Shaped, page_table: _Shaped, *, n_heads: int,
                          rotary_dim: int, u_cols: int | None = None) -> str | None:
    """Why `decode_qkv_attention_kernel` cannot take these shapes (None: it can)."""
    if u.ndim != 2 or k_pages.ndim != 4 or page_table.ndim != 2:
        return f"u must be [M, N], the pool [P, Hkv, S, Dh] and the page table [M, pages], got {u.shape}, " \
               f"{k_pages.shape}, {page_table.shape}"
    P, hkv, S, dh = k_pages.shape
    width = u.shape[1] if u_cols is None else u_cols
    if not 0 < width <= u.shape[1]:
        return f"u_cols {u_cols} must be in (0, u's width {u.shape[1]}]"
    if width != (n_heads + 2 * hkv) * dh or hkv != n_heads:
        return f"u width {width} must be 3 x heads {n_heads} x Dh {dh} (no grouped KV heads)"
    half, rest = rotary_dim // 2, dh - rotary_dim
    if rotary_dim % 2 or not _pow2(half) or not (rest == 0 or _pow2(rest)):
        return f"rotary_dim {rotary_dim} / 2 and head_dim - rotary_dim {rest} must be powers of two (or 0)"
    if not _pow2(S) or not 16 <= S <= 128:
        return f"page size {S} must be a power of two in [16, 128]"
    if jnp.dtype(u.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return f"u must be bf16 or f32, got {u.dtype}"
    if not (is_fp8(k_pages.dtype) or jnp.dtype(k_pages.dtype) == jnp.dtype(jnp.bfloat16)):
        return f"pool dtype must be float8_e4m3fn or bf16, got {k_pages.dtype}"
    if k_pages.size >= 2**31:
        return f"pool of {k_pages.size} elements: the kernel's offsets are int32"
    return None


def _bf16(x: jax.Array) -> jax.Array:
    return x.astype(jnp.bfloat16).astype(jnp.float32)


def _kernel(u_ref, pos_ref, slot_ref, len_ref, pt_ref, ks_ref, vs_ref, inv_ref, _kp_in, _vp_in,
            o_ref, lse_ref, kp_ref, vp_ref, *, n_heads: int, dh: int, rot: int, splits: int, qscale: float,
            fp8: bool, low: bool):
    # program ids are read here, outside any branch (the interpreter evaluates them only there)
    m, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    f32, i32 = jnp.float32, jnp.int32
    P, _, S, _ = kp_ref.shape
    half, rest_w = rot // 2, dh - rot
    widths = (half, half, rest_w)
    offs = (0, half, rot)
    rnd = _bf16 if low else (lambda x: x)

    def head(col):  # (first rotary half, second rotary half, pass-through channels) of one head
        return tuple(u_ref[m, pl.ds(col + o, w)].astype(f32) if w else None
                     for o, w in zip(offs, widths, strict=True))

    # every load first: the row's scalars, its three heads, its first page id
    pos, slot, kv_len = pos_ref[m], slot_ref[m], len_ref[m]
    qh, kh, vh = head(h * dh), head((n_heads + h) * dh), head((2 * n_heads + h) * dh)
    ang = pos.astype(f32) * inv_ref[...]
    cos, sin = jnp.cos(ang), jnp.sin(ang)

    def rotated(parts):
        a, b, c = parts
        return rnd(a * cos - b * sin), rnd(a * sin + b * cos), c

    q = tuple(None if x is None else rnd(x) for x in rotated(qh))
    k_new = tuple(None if x is None else rnd(x) for x in rotated(kh))
    v_new = tuple(None if x is None else rnd(x) for x in vh)

    def stored(x, sc):  # a new K or V value as the pool holds it (FP8: IEEE divide, clamp, cast)
        if not fp8:
            return x.astype(kp_ref.dtype)
        return jnp.minimum(jnp.maximum(x / sc, -FP8_MAX), FP8_MAX).astype(kp_ref.dtype)

    k_sc, v_sc = ks_ref[0], vs_ref[0]

    @pl.when((s == 0) & (slot >= 0))
    def _write():
        page = jnp.minimum(slot // S, P - 1)
        row = slot % S
        for ref, parts, sc in ((kp_ref, k_new, k_sc), (vp_ref, v_new, v_sc)):
            for off, w, x in zip(offs, widths, parts, strict=True):
                if w:
                    ref[page, h, row, pl.ds(off, w)] = stored(x, sc)

    def read_back(x, sc):  # the stored value as the cached tiles are read
        y = stored(x, sc).astype(f32)
        return y * sc if fp8 else y

    qs: tuple[Any, ...] = tuple(None if x is None else x * qscale for x in q)
    # the cached positions [0, L - 1) as page tiles, this split's share of them
    past = jnp.maximum(kv_len - 1, 0)
    n_tiles = (past + S - 1) // S
    per = (n_tiles + splits - 1) // splits
    t0 = jnp.minimum(s * per, n_tiles)
    t1 = jnp.minimum(t0 + per, n_tiles)
    rows = jnp.arange(S, dtype=i32)
    max_page = pt_ref.shape[1] - 1

    def load_tile(t):  # K and V parts of tile t (masked past L - 1 and outside [t0, t1))
        page = jnp.clip(pt_ref[m, jnp.clip(t, 0, max_page)], 0, P - 1)
        ok = ((t * S + rows) < past) & (t < t1)
        out = []
        for ref in (kp_ref, vp_ref):
            parts: list[Any] = []
            for off, w in zip(offs, widths, strict=True):
                if not w:
                    parts.append(None)
                    continue
                view = ref.at[page, h, pl.ds(0, S), pl.ds(off, w)]
                parts.append(pltriton.load(view, mask=jnp.broadcast_to(ok[:, None], (S, w)), other=0.0))
            out.append(tuple(parts))
        return ok, out[0], out[1]

    def attend(state, ok, kt, vt, k_mul, v_mul):
        m_run, l_run, acc = state
        sc = functools.reduce(jnp.add, [jnp.sum(x.astype(f32) * k_mul * qp[None, :], axis=1)
                                        for x, qp in zip(kt, qs, strict=True) if x is not None])
        sc = jnp.where(ok, sc, NEG_INF)
        m_new = jnp.maximum(m_run, jnp.max(sc))
        safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
        alpha = jnp.exp2(m_run - safe)
        p = jnp.where(ok, jnp.exp2(sc - safe), 0.0)
        acc = tuple(None if a is None else a * alpha + jnp.sum(p[:, None] * (x.astype(f32) * v_mul), axis=0)
                    for a, x in zip(acc, vt, strict=True))
        return m_new, l_run * alpha + jnp.sum(p), acc

    k_mul = k_sc if fp8 else 1.0
    v_mul = v_sc if fp8 else 1.0
    never = m < 0  # a runtime False: loop and branch carries must be values, not literals
    zero = jnp.where(never, jnp.zeros((), f32), 0.0)
    low_m = jnp.where(never, jnp.zeros((), f32), NEG_INF)
    init = (low_m, zero, tuple(None if w == 0 else jnp.zeros((w,), f32) + zero for w in widths))

    def step(t, carry):
        cur, state = carry
        nxt = load_tile(t + 1)  # issued before this tile's arithmetic: hides its latency
        return nxt, attend(state, cur[0], cur[1], cur[2], k_mul, v_mul)

    def loop(state):
        first = load_tile(t0)
        _, state = jax.lax.fori_loop(t0, t1, step, (first, state))
        return state

    m_run, l_run, acc = loop(init)

    # the last split also takes the new token (position L - 1), from registers
    own_new = (s == splits - 1) & (kv_len > 0)
    k1: tuple[Any, ...] = tuple(None if x is None else read_back(x, k_sc) for x in k_new)
    v1: tuple[Any, ...] = tuple(None if x is None else read_back(x, v_sc) for x in v_new)
    sc1 = functools.reduce(jnp.add, [jnp.sum(x * qp) for x, qp in zip(k1, qs, strict=True) if x is not None])
    sc1 = jnp.where(own_new, sc1, NEG_INF)
    m_fin = jnp.maximum(m_run, sc1)
    safe = jnp.where(m_fin == NEG_INF, 0.0, m_fin)
    alpha = jnp.exp2(m_run - safe)
    p1 = jnp.where(own_new, jnp.exp2(sc1 - safe), 0.0)
    l_fin = l_run * alpha + p1
    denom = jnp.where(l_fin > 0, l_fin, 1.0)
    for off, w, a, x in zip(offs, widths, acc, v1, strict=True):
        if w:
            o_ref[m, h, s, pl.ds(off, w)] = (a * alpha + p1 * x) / denom
    lse_ref[m, h, s] = jnp.where(l_fin > 0, m_fin + jnp.log2(denom), NEG_INF)


@functools.partial(jax.jit, static_argnames=("n_heads", "rotary_dim", "theta", "sm_scale", "splits", "interpret",
                                             "num_warps", "u_cols"))
def decode_qkv_attention_partials(
    u: jax.Array,  # [>= M, >= 3 H Dh] the QKV product (bias included); rows >= M and columns >= u_cols unread
    positions: jax.Array,  # [M] int32
    slots: jax.Array,  # [M] int32 flat KV slot; < 0 = padding row (nothing written)
    k_pages: jax.Array,  # [P, H, S, Dh] float8_e4m3fn / bf16
    v_pages: jax.Array,
    k_scale: jax.Array,  # [] f32
    v_scale: jax.Array,
    kv_lens: jax.Array,  # [M] int32 valid tokens incl. the new one; 0 = inactive row
    page_table: jax.Array,  # [M, max_pages] int32
    *,
    n_heads: int,
    rotary_dim: int,
    theta: float,
    sm_scale: float,
    splits: int | None = None,
    interpret: bool = False,
    num_warps: int = DEFAULT_WARPS,
    u_cols: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """-> (o [M, H, splits, Dh] f32 normalised split partials, lse [M, H, splits] f32 log2-sum-exp2,
    k_pages, v_pages with the M new rows written). `merge_splits(o, lse, dtype)` gives attention's
    output. `u_cols`: u is wider (a dense layer's joined QKV + fc1 product), its first u_cols
    columns being the QKV product."""
    check_pool(k_pages, v_pages)
    M = positions.shape[0]
    problem = qkv_attention_problem(u, k_pages, page_table, n_heads=n_heads, rotary_dim=rotary_dim, u_cols=u_cols)
    if problem is not None:
        raise ValueError(f"decode_qkv_attention: {problem}")
    if u.shape[0] < M or slots.shape != positions.shape or kv_lens.shape != positions.shape \
            or page_table.shape[0] != M:
        raise ValueError(f"decode_qkv_attention: u has {u.shape[0]} rows, positions {positions.shape}, slots "
                         f"{slots.shape}, kv_lens {kv_lens.shape}, page table {page_table.shape}: need M of each")
    _, _, S, dh = k_pages.shape
    max_tiles = page_table.shape[1]
    splits = splits or default_splits(M, n_heads, max_tiles)
    if not 1 <= splits <= 64:
        raise ValueError(f"decode_qkv_attention: splits must be in [1, 64], got {splits}")
    inv = jnp.asarray(rope_inv_freq(rotary_dim, theta))
    scales = [jnp.asarray(x, jnp.float32).reshape(1) for x in (k_scale, v_scale)]
    ins = [u, positions.astype(jnp.int32), slots.astype(jnp.int32), kv_lens.astype(jnp.int32),
           page_table.astype(jnp.int32), *scales, inv, k_pages, v_pages]
    kern = functools.partial(_kernel, n_heads=n_heads, dh=dh, rot=rotary_dim, splits=splits,
                             qscale=float(sm_scale) * LOG2E, fp8=is_fp8(k_pages.dtype),
                             low=jnp.dtype(u.dtype) == jnp.dtype(jnp.bfloat16))
    o, lse, kp, vp = pl.pallas_call(
        kern,
        out_shape=(jax.ShapeDtypeStruct((M, n_heads, splits, dh), jnp.float32),
                   jax.ShapeDtypeStruct((M, n_heads, splits), jnp.float32),
                   jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)),
        grid=(M, n_heads, splits),
        input_output_aliases={len(ins) - 2: 2, len(ins) - 1: 3},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kestrel_decode_qkv_attention",
    )(*ins)
    return o, lse, kp, vp


def decode_qkv_attention_kernel(u: jax.Array, positions: jax.Array, slots: jax.Array, k_pages: jax.Array,
                                v_pages: jax.Array, k_scale: jax.Array, v_scale: jax.Array, kv_lens: jax.Array,
                                page_table: jax.Array, *, n_heads: int, rotary_dim: int, theta: float,
                                sm_scale: float, splits: int | None = None, interpret: bool = False,
                                num_warps: int = DEFAULT_WARPS, u_cols: int | None = None,
                                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """-> (attention's output [M, H, Dh] in u's dtype, k_pages, v_pages): the partials merged by
    `merge_splits` (an XLA fusion)."""
    o, lse, kp, vp = decode_qkv_attention_partials(
        u, positions, slots, k_pages, v_pages, k_scale, v_scale, kv_lens, page_table, n_heads=n_heads,
        rotary_dim=rotary_dim, theta=theta, sm_scale=sm_scale, splits=splits, interpret=interpret,
        num_warps=num_warps, u_cols=u_cols)
    return merge_splits(o, lse, u.dtype), kp, vp


def decode_qkv_attention_ref(u: jax.Array, positions: jax.Array, slots: jax.Array, k_pages: jax.Array,
                             v_pages: jax.Array, k_scale: jax.Array, v_scale: jax.Array, kv_lens: jax.Array,
                             page_table: jax.Array, *, n_heads: int, rotary_dim: int, theta: float,
                             sm_scale: float, u_cols: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Reference of `decode_qkv_attention_kernel` (same arguments, no tuning ones): the model's
    jnp path, `qkv_heads_ref` (no tau), `write_kv_ref`, `decode_attention_ref`."""
    M = positions.shape[0]
    uu = u[:M, :u_cols] if u_cols is not None else u[:M]
    q, k, v = qkv_heads_ref(uu, positions, None, n_heads=n_heads, n_kv_heads=k_pages.shape[1],
                            rotary_dim=rotary_dim, theta=theta)
    kp, vp = write_kv_ref(k_pages, v_pages, k, v, slots, k_scale, v_scale)
    o = decode_attention_ref(q, kp, vp, kv_lens, page_table, k_scale, v_scale, sm_scale=sm_scale)
    return o, kp, vp
