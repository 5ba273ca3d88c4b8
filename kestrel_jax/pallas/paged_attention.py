"""Paged attention over a (optionally FP8) KV cache: pool helpers and pure-jnp references.

These are the definitions the Pallas kernels (`paged_attention_mgpu.py`,
`paged_attention_prefill_mgpu.py`) are tested against, and the CPU path of the model (through
`kestrel_jax.pallas.ops`). Signatures are identical to the kernels'.

KV pool layout (one pair of arrays per decoder layer), **head-major pages**:
    k_pages, v_pages: [num_pages, n_kv_heads, page_size, head_dim]
    dtype: float8_e4m3fn (scaled), bfloat16 or float32 (scale ignored, treated as 1).
A token at absolute position p of a sequence lives in page `page_table[p // page_size]`, row
`p % page_size` of every head; its flat slot is `page * page_size + row`. Head-major pages make
one (page, head) block `page_size * head_dim` contiguous elements (4 KiB in FP8 at page 64), so
the kernels fetch a head's keys with one dense TMA box per page, and a decode CTA that owns one
head reads contiguous memory. Writing a token costs the same in either order (n_kv_heads
64-element rows). Page 0 is never special: any page may be handed to any sequence, and unused
pages hold arbitrary data (tests fill them with NaN) that must never reach a result.

Page size: a power of two (8..128 in the kernels). 64 is the default: one page is exactly the
decode kernel's 64-row tile and the prefill kernel's 64-key tile (one TMA box per page-head,
4 KiB in FP8), a 2048-token context needs a 32-entry page-table row, and the slack is small
(a 740-token image prompt fills 12 pages, 3.6% unused, vs 1.6% at page 16, which would need
4 TMA boxes per tile and a 4x longer table). Measured on an H100 (`tools/bench_attention.py
--page-sweep`, BENCHMARKS.md, third session): decode kernel time is within 2% across pages
16..128 at B=8/KV 512, B=32/KV 128 and B=64/KV 2048; prefill of a 740-token image is 29.8 us at
pages 32..128 and 32.2 us at page 16; at B=1/KV 740 the kernel takes 5.3 us at every page
size but the split-KV merge 3.1 us at page 128 against 1.3 us at page 64. 64 is the smallest
page with the best times.

Scales: one float32 scalar per layer for K and one for V; stored = clip(x / scale, +-448) in
e4m3 (no NaN codes), read back as stored * scale. Take them from the checkpoint when it has
them, else calibrate with `calibrate_kv_scale` (absmax / 448 with a margin).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_MAX = 448.0
FP8_DTYPE = jnp.float8_e4m3fn
DEFAULT_PAGE_SIZE = 64


class KVLayoutError(ValueError):
    """Pool, page table or token arrays have inconsistent shapes or dtypes."""


def is_fp8(dtype: jnp.dtype) -> bool:
    return jnp.dtype(dtype) == jnp.dtype(FP8_DTYPE)


def init_kv_pool(
    num_layers: int,
    num_pages: int,
    page_size: int = DEFAULT_PAGE_SIZE,
    n_kv_heads: int = 32,
    head_dim: int = 64,
    dtype: jnp.dtype = FP8_DTYPE,
) -> tuple[tuple[jax.Array, jax.Array], ...]:
    """Zero-filled pool: one (k_pages, v_pages) pair per layer, each [P, Hkv, S, D]."""
    if page_size < 1 or page_size & (page_size - 1):
        raise KVLayoutError(f"page_size must be a power of two, got {page_size}")
    if num_layers < 1 or num_pages < 1:
        raise KVLayoutError(f"need at least one layer and one page, got {num_layers}, {num_pages}")
    shape = (num_pages, n_kv_heads, page_size, head_dim)
    return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(num_layers))


def calibrate_kv_scale(x: jax.Array, margin: float = 1.25) -> jax.Array:
    """Per-layer scale from calibration K or V values (any shape): absmax * margin / 448.

    The margin leaves headroom for activations larger than the calibration set's (they clamp to
    +-448 rather than overflow); an all-zero input gives scale 1.
    """
    if margin < 1.0:
        raise ValueError(f"margin must be >= 1 (headroom above the calibration absmax), got {margin}")
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    return jnp.where(amax > 0, amax * margin / FP8_MAX, 1.0).astype(jnp.float32)


def quantize_kv(x: jax.Array, scale: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Convert new K or V rows to the pool's storage dtype (clamped e4m3 when FP8)."""
    if is_fp8(dtype):
        y = jnp.clip(x.astype(jnp.float32) / scale, -FP8_MAX, FP8_MAX)
        return y.astype(dtype)
    return x.astype(dtype)


def dequantize_kv(x: jax.Array, scale: jax.Array) -> jax.Array:
    """Stored K or V -> float32."""
    if is_fp8(x.dtype):
        return x.astype(jnp.float32) * scale
    return x.astype(jnp.float32)


def check_pool(k_pages: jax.Array, v_pages: jax.Array) -> None:
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
        raise KVLayoutError(
            "k_pages and v_pages must both be [num_pages, n_kv_heads, page_size, head_dim] of one "
            f"dtype, got {k_pages.shape} {k_pages.dtype} and {v_pages.shape} {v_pages.dtype}"
        )


def write_kv_ref(
    k_pages: jax.Array,  # [P, Hkv, S, D]
    v_pages: jax.Array,  # [P, Hkv, S, D]
    k: jax.Array,  # [T, Hkv, D] post-rotary K
    v: jax.Array,  # [T, Hkv, D] post-tau V
    slots: jax.Array,  # [T] int32 flat slot; < 0 = padding row, not written
    k_scale: jax.Array,  # [] f32
    v_scale: jax.Array,  # [] f32
) -> tuple[jax.Array, jax.Array]:
    check_pool(k_pages, v_pages)
    P, H, S, D = k_pages.shape
    idx = jnp.where(slots < 0, P * S, slots)  # out of range -> dropped
    page, row = idx // S, idx % S
    kq = quantize_kv(k, k_scale, k_pages.dtype)
    vq = quantize_kv(v, v_scale, v_pages.dtype)
    heads = jnp.arange(H)[None, :]
    kp = k_pages.at[page[:, None], heads, row[:, None]].set(kq, mode="drop")
    vp = v_pages.at[page[:, None], heads, row[:, None]].set(vq, mode="drop")
    return kp, vp


def _gather_seq(pages: jax.Array, table_row: jax.Array, scale: jax.Array) -> jax.Array:
    """[max_pages] page ids -> [max_pages * S, Hkv, D] float32 keys/values of one sequence."""
    P, H, S, D = pages.shape
    safe = jnp.clip(table_row, 0, P - 1)
    g = pages[safe].transpose(0, 2, 1, 3)  # [max_pages, S, H, D]
    return dequantize_kv(g.reshape(-1, H, D), scale)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, sm_scale: float) -> jax.Array:
    """q [Tq, H, D] f32; k, v [Tk, Hkv, D] f32; mask [Tq, Tk] bool -> [Tq, H, D] f32.

    Rows whose mask is all False produce zeros; masked keys never reach the result, even when
    they hold NaN.
    """
    Tq, H, D = q.shape
    Hkv = k.shape[1]
    g = H // Hkv
    qg = q.reshape(Tq, Hkv, g, D)
    s = jnp.einsum("qhgd,khd->hgqk", qg, k, precision=jax.lax.Precision.HIGHEST) * sm_scale
    s = jnp.where(mask[None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask[None, None], jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    v = jnp.where(jnp.any(mask, axis=0)[:, None, None], v, 0.0)
    o = jnp.einsum("hgqk,khd->qhgd", p, v, precision=jax.lax.Precision.HIGHEST)
    o = o / jnp.where(denom == 0, 1.0, denom).transpose(2, 0, 1, 3)
    return o.reshape(Tq, H, D)


def decode_attention_ref(
    q: jax.Array,  # [B, H, D]
    k_pages: jax.Array,  # [P, Hkv, S, D]
    v_pages: jax.Array,  # [P, Hkv, S, D]
    kv_lens: jax.Array,  # [B] int32 valid tokens incl. the current one; 0 = inactive row
    page_table: jax.Array,  # [B, max_pages] int32
    k_scale: jax.Array,  # [] f32
    v_scale: jax.Array,  # [] f32
    *,
    sm_scale: float,
) -> jax.Array:  # [B, H, D] in q.dtype; inactive rows are zero
    check_pool(k_pages, v_pages)
    S = k_pages.shape[2]
    max_len = page_table.shape[1] * S

    def one(qb: jax.Array, row: jax.Array, n: jax.Array) -> jax.Array:
        k = _gather_seq(k_pages, row, k_scale)
        v = _gather_seq(v_pages, row, v_scale)
        mask = (jnp.arange(max_len) < n)[None, :]
        return _attend(qb[None].astype(jnp.float32), k, v, mask, sm_scale)[0]

    out = jax.vmap(one)(q, page_table, kv_lens)
    return out.astype(q.dtype)


def prefill_attention_ref(
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
) -> jax.Array:  # [T, H, D] in q.dtype; padding rows are zero
    """Query i of sequence b sits at position kv_lens[b] - q_len_b + i and may attend key j iff
    j < kv_lens[b] and (j <= pos or (pos < prefix_lens[b] and j < prefix_lens[b])).
    """
    check_pool(k_pages, v_pages)
    T = q.shape[0]
    B = kv_lens.shape[0]
    S = k_pages.shape[2]
    max_len = page_table.shape[1] * S
    t = jnp.arange(T)
    j = jnp.arange(max_len)
    out = jnp.zeros(q.shape, jnp.float32)
    qf = q.astype(jnp.float32)
    for b in range(B):  # static: B is a bucket size
        start, end = cu_q_lens[b], cu_q_lens[b + 1]
        in_seq = (t >= start) & (t < end)
        pos = kv_lens[b] - (end - start) + (t - start)  # [T]
        pre = prefix_lens[b]
        causal = j[None, :] <= pos[:, None]
        bidir = (pos[:, None] < pre) & (j[None, :] < pre)
        mask = in_seq[:, None] & (j[None, :] < kv_lens[b]) & (causal | bidir)
        k = _gather_seq(k_pages, page_table[b], k_scale)
        v = _gather_seq(v_pages, page_table[b], v_scale)
        o = _attend(qf, k, v, mask, sm_scale)
        out = jnp.where(in_seq[:, None, None], o, out)
    return out.astype(q.dtype)
