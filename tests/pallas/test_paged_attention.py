"""Paged attention: the jnp references against a float64 numpy oracle, the Mosaic GPU kernels
(interpreted on CPU) against the references, and cross-lowering of every kernel at production
shapes for an abstract H100.

Every test draws fresh random inputs (seed printed; pytest shows it on failure), scrambles the
page table and fills every KV slot that no sequence owns (unused pages, the tail of each last
page) with NaN: a kernel that reads or multiplies such a slot into a result fails.

Error bounds (|out - ref| <= ATOL * max|v| + RTOL * |ref|, per dtype):
  * outputs are rounded to bf16 once: 2^-9 relative, so RTOL = 2^-7 leaves room for ties and
    the different summation order;
  * decode accumulates in f32 on CUDA cores (error ~1e-6 relative): ATOL = 2^-10;
  * prefill rounds P (and, for FP8 pools, Q) to the wgmma operand type before the MMA: bf16
    operands (bf16 pools) err by <= 2^-9 relative per product, so the output by <= 2^-9 max|v|:
    ATOL = 2^-8; f16 operands (FP8 pools; e4m3 K/V are exact in f16) by 2^-12: ATOL = 2^-10.
FP8 quantisation error itself is not part of these bounds: the references read the same e4m3
values the kernels read. The write kernel must match the reference bit for bit (same IEEE
division and round-to-nearest-even e4m3 conversion after the clamp).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType
from kernel_helpers import as_f32, fresh_rng

from kestrel_jax.pallas import paged_attention as pa
from kestrel_jax.pallas import paged_attention_mgpu as pm
from kestrel_jax.pallas import paged_attention_prefill_mgpu as pp

FP8 = jnp.float8_e4m3fn
BF16 = jnp.bfloat16
SM_SCALE = 0.125
# The references under jit, as the engine's CPU steps run them (op by op, each test's new shapes
# compiled dozens of small programs: ~25% of this file's time).
_decode_ref = jax.jit(pa.decode_attention_ref, static_argnames="sm_scale")
_prefill_ref = jax.jit(pa.prefill_attention_ref, static_argnames="sm_scale")


def _make_pool(rng, num_pages, n_kv, page, dtype, kv_lens, max_pages, n_seqs):
    """Random pool holding `kv_lens[b]` tokens per sequence; all other slots NaN."""
    scales = (np.float32(rng.uniform(0.01, 0.05)), np.float32(rng.uniform(0.01, 0.05)))
    table = rng.permutation(num_pages)[: n_seqs * max_pages].reshape(n_seqs, max_pages).astype(np.int32)
    owned = np.zeros((num_pages, page), bool)
    for b in range(n_seqs):
        for t in range(int(kv_lens[b])):
            owned[table[b, t // page], t % page] = True
    pools = []
    for scale in scales:
        x = jnp.asarray(rng.standard_normal((num_pages, n_kv, page, 64)) * 3.0, jnp.float32)
        pools.append(_stored(x, jnp.float32(scale), jnp.asarray(owned), dtype))
    return pools[0], pools[1], jnp.asarray(table), jnp.float32(scales[0]), jnp.float32(scales[1])


@functools.partial(jax.jit, static_argnames="dtype")
def _stored(x: jax.Array, scale: jax.Array, owned: jax.Array, dtype: Any) -> jax.Array:
    """x quantised into the pool's dtype where a sequence owns the slot, NaN elsewhere (one program
    per pool shape; kernels and references read the same stored values)."""
    nan = jnp.asarray(np.nan, jnp.float32).astype(dtype)
    return jnp.where(owned[:, None, :, None], pa.quantize_kv(x, scale, dtype), nan)


def _vmax(v_pages, table, kv_lens, v_scale) -> float:
    page = v_pages.shape[2]
    v = np.abs(as_f32(pa.dequantize_kv(v_pages, v_scale)))  # elementwise: each slot's values as alone
    vals = [v[table[b, t // page], :, t % page].max() for b in range(len(kv_lens)) for t in range(int(kv_lens[b]))]
    return float(max(vals)) if vals else 1.0


def _check(out, ref, vmax, atol, rtol=2.0**-7, what=""):
    out, ref = as_f32(out), as_f32(ref)
    assert not np.isnan(out).any(), f"{what}: NaN in kernel output (a poisoned slot leaked)"
    err = np.abs(out - ref)
    bound = atol * vmax + rtol * np.abs(ref)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), (f"{what}: max err {err.max():.3g} exceeds bound at {worst}: "
                                  f"out {out[worst]:.5g} ref {ref[worst]:.5g} bound {bound[worst]:.3g}")


# ------------------------------------------------------------------------- numpy oracle


def _oracle(q, k_pages, v_pages, table, k_scale, v_scale, rows):
    """rows: list of (query index, sequence, position, kv_len, prefix) -> [T, H, D] float64."""
    P, Hkv, S, D = k_pages.shape
    H = q.shape[1]
    g = H // Hkv
    kf = as_f32(pa.dequantize_kv(k_pages, k_scale)).astype(np.float64)
    vf = as_f32(pa.dequantize_kv(v_pages, v_scale)).astype(np.float64)
    qf = as_f32(q).astype(np.float64)
    out = np.zeros(qf.shape)
    for i, b, pos, n, pre in rows:
        keys = np.array([j for j in range(n) if j <= pos or (pos < pre and j < pre)], np.int64)
        if not keys.size:
            continue
        pages = table[b, keys // S]
        kk = kf[pages, :, keys % S]  # [keys, Hkv, D]
        vv = vf[pages, :, keys % S]
        for h in range(H):
            s = kk[:, h // g] @ qf[i, h] * SM_SCALE
            w = np.exp(s - s.max())
            out[i, h] = (w / w.sum()) @ vv[:, h // g]
    return out


def test_references_match_float64_oracle():
    rng = fresh_rng()
    page, n_kv, g = 8, 2, 2
    kv_lens = np.array([1, 7, 8, 9, 19], np.int32)
    k_pages, v_pages, table, ks, vs = _make_pool(rng, 20, n_kv, page, FP8, kv_lens, 3, 5)
    q = jnp.asarray(rng.standard_normal((5, n_kv * g, 64)), jnp.float32)
    dec = _decode_ref(q, k_pages, v_pages, jnp.asarray(kv_lens), table, ks, vs, sm_scale=SM_SCALE)
    rows = [(b, b, int(n) - 1, int(n), 0) for b, n in enumerate(kv_lens)]
    np.testing.assert_allclose(as_f32(dec), _oracle(q, k_pages, v_pages, np.asarray(table), ks, vs, rows),
                               rtol=1e-5, atol=1e-5)

    # Prefill: (new tokens, cached tokens, prefix) covering prefix < / = / > new tokens.
    segs = [(6, 0, 4), (5, 3, 8), (4, 0, 4), (3, 5, 0)]
    kvl = np.array([n + c for n, c, _ in segs], np.int32)
    k_pages, v_pages, table, ks, vs = _make_pool(rng, 20, n_kv, page, BF16, kvl, 3, len(segs))
    cu = np.r_[0, np.cumsum([n for n, _, _ in segs])].astype(np.int32)
    q = jnp.asarray(rng.standard_normal((int(cu[-1]) + 2, n_kv * g, 64)), jnp.float32)  # 2 padding rows
    pre = np.array([p for _, _, p in segs], np.int32)
    out = _prefill_ref(q, k_pages, v_pages, jnp.asarray(cu), jnp.asarray(kvl), table,
                                   jnp.asarray(pre), ks, vs, sm_scale=SM_SCALE)
    rows = [(int(cu[b]) + i, b, c + i, n + c, p) for b, (n, c, p) in enumerate(segs) for i in range(n)]
    np.testing.assert_allclose(as_f32(out), _oracle(q, k_pages, v_pages, np.asarray(table), ks, vs, rows),
                               rtol=1e-5, atol=1e-5)


def test_pool_helpers_and_quantisation():
    pool = pa.init_kv_pool(3, 5, 16, 2, 64, FP8)
    assert len(pool) == 3 and all(k.shape == (5, 2, 16, 64) and k.dtype == FP8 for k, _ in pool)
    assert all(not np.any(as_f32(x)) for kv in pool for x in kv)
    with pytest.raises(pa.KVLayoutError):
        pa.init_kv_pool(1, 4, 24, 2, 64)
    rng = fresh_rng()
    x = jnp.asarray(rng.standard_normal((100, 2, 64)) * rng.uniform(0.1, 50), jnp.float32)
    scale = pa.calibrate_kv_scale(x, margin=1.25)
    np.testing.assert_allclose(float(scale), float(jnp.max(jnp.abs(x))) * 1.25 / 448, rtol=1e-6)
    assert float(pa.calibrate_kv_scale(jnp.zeros((4, 4)))) == 1.0
    big = pa.quantize_kv(x * 10, scale, FP8)  # far past the calibrated range: clamps, never NaN
    assert not np.isnan(as_f32(big)).any() and np.abs(as_f32(big)).max() == 448.0


# ------------------------------------------------------------------------ write kernel


@pytest.mark.parametrize("dtype", [FP8, BF16], ids=["fp8", "bf16"])
def test_write_kernel_interpreted(dtype):
    rng = fresh_rng()
    P, H, S, T = 6, 2, 16, 6
    k_pages = jnp.asarray(rng.standard_normal((P, H, S, 64)), jnp.float32).astype(dtype)
    v_pages = jnp.asarray(rng.standard_normal((P, H, S, 64)), jnp.float32).astype(dtype)
    k = jnp.asarray(rng.standard_normal((T, H, 64)) * 40, BF16)  # some beyond 448 * scale: clamped
    v = jnp.asarray(rng.standard_normal((T, H, 64)), BF16)
    slots = np.r_[rng.choice(P * S, T - 2, replace=False), -1, -1].astype(np.int32)
    rng.shuffle(slots)
    ks, vs = jnp.float32(0.05), jnp.float32(0.01)
    write = jax.jit(functools.partial(pm.write_kv_kernel, interpret=True))
    got = write(k_pages, v_pages, k, v, jnp.asarray(slots), ks, vs)
    want = pa.write_kv_ref(k_pages, v_pages, k, v, jnp.asarray(slots), ks, vs)
    for g_, w_ in zip(got, want, strict=True):
        assert g_.dtype == dtype
        np.testing.assert_array_equal(as_f32(g_), as_f32(w_))
    if dtype == FP8:
        assert np.abs(as_f32(got[0])).max() == 448.0


# ----------------------------------------------------------------------- decode kernel


@pytest.mark.parametrize(
    "dtype,page,splits,group,n_kv,tile_rows",
    [(FP8, 16, 1, 1, 1, 64), (FP8, 64, 3, 1, 1, 64), (BF16, 32, 2, 2, 1, 64),
     # two KV heads (each case names its tile size: over these short tables the plan would pick 16)
     (FP8, 16, 1, 1, 2, 64),
     # 16-row tiles: 8 channels of one key row per thread in their own layout; a page of 8 is half a tile
     (FP8, 64, 3, 1, 1, 16), (FP8, 8, 1, 1, 2, 16), (BF16, 16, 2, 2, 1, 16)],
    ids=["fp8-p16-nosplit", "fp8-p64-split3", "bf16-p32-split2-gqa2",
         "fp8-p16-2kv-nosplit",
         "fp8-p64-split3-t16", "fp8-p8-2kv-t16", "bf16-p16-split2-gqa2-t16"],
)
def test_decode_kernel_interpreted(dtype, page, splits, group, n_kv, tile_rows):
    rng = fresh_rng()
    max_pages = 5
    # lengths 1, page-1, page, page+1, a long random one, and an inactive row (0)
    kv_lens = np.array([1, page - 1, page, page + 1, rng.integers(2 * page, max_pages * page + 1), 0], np.int32)
    B = len(kv_lens)
    k_pages, v_pages, table, ks, vs = _make_pool(rng, B * max_pages + 3, n_kv, page, dtype, kv_lens,
                                                 max_pages, B)
    q = jnp.asarray(rng.standard_normal((B, n_kv * group, 64)), BF16)
    lens = jnp.asarray(kv_lens)
    f = jax.jit(functools.partial(pm.decode_attention_kernel, sm_scale=SM_SCALE, num_splits=splits,
                                  tile_rows=tile_rows, interpret=True))
    out = f(q, k_pages, v_pages, lens, table, ks, vs)
    ref = _decode_ref(q, k_pages, v_pages, lens, table, ks, vs, sm_scale=SM_SCALE)
    assert out.shape == q.shape and out.dtype == q.dtype
    _check(out, ref, _vmax(v_pages, np.asarray(table), kv_lens, vs), atol=2.0**-10, what="decode")
    assert not np.any(as_f32(out)[-1]), "inactive row (kv_len 0) must be zero"


def test_decode_kernel_prefetch_targets_change_nothing():
    """L2 prefetch targets (a whole weight and a non-viewable one that is skipped; two routed
    expert weights with their block table and a non-viewable one) shift none of the kernel's own
    refs: the output is the same bit for bit as without them."""
    rng = fresh_rng()
    kv_lens = np.array([5, 64, 65, 200], np.int32)
    B = len(kv_lens)
    k_pages, v_pages, table, ks, vs = _make_pool(rng, B * 4 + 3, 2, 64, FP8, kv_lens, 4, B)
    q = jnp.asarray(rng.standard_normal((B, 2, 64)), BF16)
    lens = jnp.asarray(kv_lens)
    w = jnp.asarray(rng.standard_normal((256, 64)), BF16)
    odd = jnp.zeros((3, 100), BF16)
    up = jnp.asarray(rng.standard_normal((4, 512, 128)), jnp.float32).astype(FP8)
    down = jnp.asarray(rng.standard_normal((4, 128, 256)), jnp.float32).astype(FP8)
    meta = jnp.zeros((1, 3, 64), jnp.int32).at[0, 0, :2].set(jnp.array([3, 1])).at[0, 2, 0].set(2)
    f = functools.partial(pm.decode_attention_kernel, sm_scale=SM_SCALE, num_splits=2, interpret=True)
    plain = jax.jit(f)(q, k_pages, v_pages, lens, table, ks, vs)
    assert np.isfinite(as_f32(plain)).all()
    for late, part in ((False, 1), (True, 2)):
        pf = jax.jit(functools.partial(f, prefetch_max_blocks=2, prefetch_late=late, prefetch_expert_part=part))(
            q, k_pages, v_pages, lens, table, ks, vs, prefetch=(w, odd),
            prefetch_experts=((up, meta), (down, meta), (odd[None], meta)))
        np.testing.assert_array_equal(as_f32(pf), as_f32(plain))


def test_decode_kernel_hands_out_unmerged_partials_padded_to_the_gemm_rows():
    """With `partial_rows` the split partials come back unmerged, padded to that many rows, with
    `planned_splits` splits: merged as the kernel merges them they are its output bit for bit. With
    one split there is nothing to merge and the output is the usual one."""
    rng = fresh_rng()
    kv_lens = np.array([5, 130, 0], np.int32)
    B = len(kv_lens)
    k_pages, v_pages, table, ks, vs = _make_pool(rng, B * 4 + 3, 2, 64, FP8, kv_lens, 4, B)
    q = jnp.asarray(rng.standard_normal((B, 2, 64)), BF16)
    lens = jnp.asarray(kv_lens)
    f = functools.partial(pm.decode_attention_kernel, sm_scale=SM_SCALE, num_splits=2, interpret=True)
    merged = jax.jit(f)(q, k_pages, v_pages, lens, table, ks, vs)
    o, lse = jax.jit(functools.partial(f, partial_rows=8))(q, k_pages, v_pages, lens, table, ks, vs)
    splits = pm.planned_splits(B, 2, table.shape[1], 64, 2)
    assert o.shape == (8, 2, splits, 64) and lse.shape == (8, 2, splits) and splits == 2
    np.testing.assert_array_equal(as_f32(pm.merge_splits(o[:B], lse[:B], BF16)), as_f32(merged))
    one = jax.jit(functools.partial(f, num_splits=1, partial_rows=8))(q, k_pages, v_pages, lens, table, ks, vs)
    assert not isinstance(one, tuple) and one.shape == q.shape
    assert pm.planned_splits(1, 32, 12, 64) == 4  # MD3 at batch 1, ~740 cached tokens


def test_default_num_splits_fills_the_sms_once(monkeypatch):
    """At most one CTA per SM (132 on the H100), never more splits than tiles, none once the
    batch's heads fill the SMs; KESTREL_JAX_DECODE_SPLITS keeps the older rule and fixed counts."""
    monkeypatch.delenv("KESTREL_JAX_DECODE_SPLITS", raising=False)
    assert [pm.default_num_splits(b, 32, 64) for b in (1, 2, 3, 4, 8, 64)] == [4, 2, 1, 1, 1, 1]
    assert pm.default_num_splits(1, 32, 3) == 3  # capped by the tiles
    assert pm.default_num_splits(1, 1, 64) == 16  # and by 16
    for b in range(1, 9):
        for tiles in (1, 2, 12, 64):
            n = pm.default_num_splits(b, 32, tiles)
            assert 1 <= n <= tiles and (n == 1 or b * 32 * n <= 132)
    monkeypatch.setenv("KESTREL_JAX_DECODE_SPLITS", "old")  # ~2 CTAs per SM
    assert [pm.default_num_splits(b, 32, 64) for b in (1, 4, 8)] == [9, 3, 1]
    monkeypatch.setenv("KESTREL_JAX_DECODE_SPLITS", "2")
    assert [pm.default_num_splits(b, 32, 64) for b in (1, 8)] == [2, 2]
    assert pm.default_num_splits(1, 32, 1) == 1
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("KESTREL_JAX_DECODE_SPLITS", bad)
        with pytest.raises(ValueError, match="KESTREL_JAX_DECODE_SPLITS"):
            pm.default_num_splits(1, 32, 64)


# ---------------------------------------------------------------------- prefill kernel

# (new tokens, cached tokens, bidirectional prefix) per sequence
_FULL_IMAGE = (100, 0, 90)  # prefix shorter than the new tokens
_CACHE_HIT = (12, 40, 40)  # prompt after a cached image prefix: every query is causal
_PREFIX_EQ = (64, 0, 64)  # prefix equal to the new tokens
_PREFIX_GT = (30, 20, 45)  # chunk inside a longer prefix: queries 20..44 see all of 0..44
_TEXT_ONLY = (9, 0, 0)


@pytest.mark.parametrize(
    "dtype,page,group,segs,pad,consumers,races,kw",
    [  # the default picks 128-row warpgroups for the first two (T > 64 x consumers), 64 for the third
        (FP8, 16, 1, [_FULL_IMAGE, _CACHE_HIT, _PREFIX_GT], 5, 2, True, {}),
        (BF16, 64, 2, [_PREFIX_EQ, _TEXT_ONLY, _CACHE_HIT], 0, 1, False, {}),
        (FP8, 128, 1, [_TEXT_ONLY, (20, 150, 160)], 3, 3, True, {}),
        (FP8, 32, 1, [_CACHE_HIT, _FULL_IMAGE], 0, 2, True, {"wg_rows": 64, "pingpong": False}),
        # 128-key tiles: kv lengths 100 / 170 / 50 / 64 / 52 (none or one full tile, ragged tails),
        # prefixes of 90 / 160 / 45 / 64 (160: an unmasked first tile, then a masked one)
        (FP8, 16, 1, [_FULL_IMAGE, (20, 150, 160), _PREFIX_GT], 5, 2, True, {"block_k": 128}),
        (BF16, 64, 2, [_PREFIX_EQ, (20, 150, 160), _CACHE_HIT], 0, 3, False, {"block_k": 128}),
        # four 64-row consumers (their default: three staging slots)
        (FP8, 32, 1, [_FULL_IMAGE, (20, 150, 160), _TEXT_ONLY], 3, 4, True, {"wg_rows": 64}),
    ],
    ids=["fp8-p16-2wg-races", "bf16-p64-gqa2-1wg", "fp8-p128-short-3wg-races", "fp8-p32-64rows-nopingpong",
         "fp8-p16-2wg-bk128-races", "bf16-p64-gqa2-3wg-bk128", "fp8-p32-4wg-races"],
)
def test_prefill_kernel_interpreted(dtype, page, group, segs, pad, consumers, races, kw):
    rng = fresh_rng()
    n_kv = 1
    kvl = np.array([n + c for n, c, _ in segs], np.int32)
    max_pages = -(-int(kvl.max()) // page) + 1
    k_pages, v_pages, table, ks, vs = _make_pool(rng, len(segs) * max_pages + 2, n_kv, page, dtype, kvl,
                                                 max_pages, len(segs))
    cu = np.r_[0, np.cumsum([n for n, _, _ in segs])].astype(np.int32)
    q = jnp.asarray(rng.standard_normal((int(cu[-1]) + pad, n_kv * group, 64)), BF16)
    args = (q, k_pages, v_pages, jnp.asarray(cu), jnp.asarray(kvl), table,
            jnp.asarray([p for _, _, p in segs], jnp.int32), ks, vs)
    f = jax.jit(functools.partial(pp.prefill_attention_kernel, sm_scale=SM_SCALE, interpret=True,
                                  detect_races=races, num_consumers=consumers, **kw))
    out = f(*args)
    if races:
        assert not pm.interpret_races_found(), "race detected between warpgroups"
    ref = _prefill_ref(*args, sm_scale=SM_SCALE)
    assert out.shape == q.shape and out.dtype == q.dtype
    atol = 2.0**-10 if dtype == FP8 else 2.0**-8
    _check(out, ref, _vmax(v_pages, np.asarray(table), kvl, vs), atol=atol, what="prefill")
    if pad:
        assert not np.any(as_f32(out)[int(cu[-1]):]), "padding rows must be zero"


def test_decode_kernel_refuses_tile_rows_it_cannot_run():
    pool = _SDS((16, 4, 16, 64), FP8)
    args = (_SDS((2, 4, 64), BF16), pool, pool, _SDS((2,), jnp.int32), _SDS((2, 4), jnp.int32), _F32, _F32)
    for rows in (8, 32, 48, 128):
        with pytest.raises(ValueError, match="tile_rows"):
            jax.eval_shape(functools.partial(pm.decode_attention_kernel, sm_scale=SM_SCALE, tile_rows=rows), *args)
    for rows in (16, 64):
        jax.eval_shape(functools.partial(pm.decode_attention_kernel, sm_scale=SM_SCALE, tile_rows=rows), *args)


def test_decode_tile_plan():
    """16-row tiles in an eight-slot ring only without splits over a short page table: <= 128 keys,
    or <= 256 keys at two to eight CTAs per SM; given values are kept."""
    plan = pm.decode_tile_plan
    assert plan(32, 32, 2, 64) == (16, 8)  # B=32 at 128 tokens: 1,024 CTAs
    assert plan(32, 32, 16, 16) == (16, 8) and plan(32, 32, 1, 128) == (16, 8) and plan(128, 32, 2, 64) == (16, 8)
    assert plan(8, 32, 1, 64) == (16, 8) and plan(8, 32, 2, 64) == (16, 8)  # 256 CTAs at 64 / 128 keys
    assert plan(16, 32, 4, 64) == (16, 8) and plan(32, 32, 4, 64) == (16, 8)  # 256 keys: 512 / 1,024 CTAs
    assert plan(8, 32, 4, 64) == (64, None) and plan(64, 32, 4, 64) == (64, None)  # 256 keys: 256 / 2,048 CTAs
    assert plan(32, 32, 5, 64) == (64, None) and plan(32, 32, 3, 128) == (64, None)  # 320 and 384 keys
    assert plan(1, 32, 2, 64) == (64, None) and plan(2, 32, 1, 64) == (64, None)  # small grids: splits
    assert plan(32, 32, 2, 64, num_splits=2) == (64, None)
    assert plan(32, 32, 2, 64, tile_rows=64) == (64, None) and plan(1, 32, 12, 64, tile_rows=16) == (16, None)
    assert plan(32, 32, 2, 64, depth=2) == (16, 2)


def test_decode_kernel_default_plan_interpreted(monkeypatch: pytest.MonkeyPatch):
    """The default plan's 16-row tiles, run interpreted against the reference: with the SM count the
    plan sizes its grid by set to 2, six sequences of one KV head over a 64-key table are a large
    grid over a short table (lengths 1, page-1, page, page+1, a random one, an inactive row)."""
    monkeypatch.setattr(pm, "_NUM_SMS", 2)
    chosen: list[tuple[int, int | None]] = []
    real_plan = pm.decode_tile_plan

    def spy(*a: Any) -> tuple[int, int | None]:
        chosen.append(real_plan(*a))
        return chosen[-1]

    monkeypatch.setattr(pm, "decode_tile_plan", spy)
    rng = fresh_rng()
    page, max_pages = 16, 4
    kv_lens = np.array([1, page - 1, page, page + 1, rng.integers(2, max_pages * page + 1), 0], np.int32)
    B = len(kv_lens)
    k_pages, v_pages, table, ks, vs = _make_pool(rng, B * max_pages + 3, 1, page, FP8, kv_lens, max_pages, B)
    q = jnp.asarray(rng.standard_normal((B, 1, 64)), BF16)
    lens = jnp.asarray(kv_lens)
    out = jax.jit(functools.partial(pm.decode_attention_kernel, sm_scale=SM_SCALE, interpret=True))(
        q, k_pages, v_pages, lens, table, ks, vs)
    assert chosen == [(16, 8)]
    ref = _decode_ref(q, k_pages, v_pages, lens, table, ks, vs, sm_scale=SM_SCALE)
    _check(out, ref, _vmax(v_pages, np.asarray(table), kv_lens, vs), atol=2.0**-10, what="decode")
    assert not np.any(as_f32(out)[-1]), "inactive row (kv_len 0) must be zero"


def test_kernels_reject_unsupported_shapes():
    q = jnp.zeros((2, 4, 128), BF16)
    pool = jnp.zeros((4, 4, 16, 128), FP8)
    table = jnp.zeros((2, 2), jnp.int32)
    assert not pm.decode_attention_kernel_supported(q, pool, table)
    assert not pp.prefill_attention_kernel_supported(q, pool, table)
    with pytest.raises(pa.KVLayoutError, match="decode_attention_ref"):
        pm.decode_attention_kernel(q, pool, pool, jnp.zeros((2,), jnp.int32), table, jnp.float32(1.0),
                                   jnp.float32(1.0), sm_scale=0.1)
    with pytest.raises(pa.KVLayoutError):
        pm.write_kv_kernel(pool, pool, jnp.zeros((3, 4, 64), BF16), jnp.zeros((3, 4, 64), BF16),
                           jnp.zeros((3,), jnp.int32), jnp.float32(1.0), jnp.float32(1.0))


# ------------------------------------------------------------- cross-lowering for H100

_SDS = jax.ShapeDtypeStruct
_F32 = _SDS((), jnp.float32)


def _lower_for_h100(f, *specs) -> str:
    """Trace and lower `f` for CUDA on a CPU-only machine.

    What works in jax 0.11.2: `jax.jit(f).trace(*specs).lower(lowering_platforms=("cuda",))`
    inside `use_abstract_mesh` with an abstract H100 device. This runs the Pallas -> Mosaic GPU
    lowering including layout inference, SMEM allocation and the TMA/tiling legality checks,
    and embeds the Mosaic module in the StableHLO custom call. It does not run LLVM/ptxas
    (register allocation, spills) or check the shared-memory limit: only the GPU does that.
    """
    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(f).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    return text


@pytest.mark.parametrize("dtype", [FP8, BF16], ids=["fp8", "bf16"])
def test_kernels_lower_at_production_shapes(dtype):
    t0 = time.time()
    P, S = 8192, 64  # 512k tokens of pool; MD3: 32 KV heads x 64
    pool = _SDS((P, 32, S, 64), dtype)
    fp8 = dtype == FP8
    for B, kv, splits in [(64, 2048, None), (1, 740, None), (32, 128, 1)][: 3 if fp8 else 1]:
        table = _SDS((B, -(-kv // S)), jnp.int32)
        dec = functools.partial(pm.decode_attention_kernel, sm_scale=SM_SCALE, num_splits=splits)
        _lower_for_h100(dec, _SDS((B, 32, 64), BF16), pool, pool, _SDS((B,), jnp.int32), table, _F32, _F32)
    if fp8:  # batch 1 with L2 prefetch targets (MD3's output projection, up and down experts, top 8),
        # the partials unmerged for the projection GEMM
        table = _SDS((1, 12), jnp.int32)

        def dec_pf(q, kp, vp, lens, pt, ks, vs, w, up, down, meta):
            return pm.decode_attention_kernel(q, kp, vp, lens, pt, ks, vs, sm_scale=SM_SCALE, prefetch=(w,),
                                              prefetch_experts=((up, meta), (down, meta)), prefetch_max_blocks=8,
                                              prefetch_late=True, prefetch_expert_part=2, partial_rows=8)
        text = _lower_for_h100(dec_pf, _SDS((1, 32, 64), BF16), pool, pool, _SDS((1,), jnp.int32), table, _F32,
                               _F32, _SDS((2048, 2048), BF16), _SDS((64, 2048, 2048), FP8), _SDS((64, 2048, 1024), FP8),
                               _SDS((1, 3, 64), jnp.int32))
        for rank in (2, 3):  # the weight's [rows, 256] boxes, the experts' [expert, rows, 256] boxes
            assert f"cp.async.bulk.prefetch.tensor.{rank}d.L2" in text
    text = _lower_for_h100(pm.write_kv_kernel, pool, pool, _SDS((1024, 32, 64), BF16), _SDS((1024, 32, 64), BF16),
                           _SDS((1024,), jnp.int32), _F32, _F32)
    assert "output_operand_alias" in text  # the pools are updated in place
    for B, T in [(1, 740), (1, 1024), (16, 16 * 740)][: 3 if fp8 else 1]:
        pre = functools.partial(pp.prefill_attention_kernel, sm_scale=SM_SCALE)
        _lower_for_h100(pre, _SDS((T, 32, 64), BF16), pool, pool, _SDS((B + 1,), jnp.int32),
                        _SDS((B,), jnp.int32), _SDS((B, 32), jnp.int32), _SDS((B,), jnp.int32), _F32, _F32)
    print(f"lowered in {time.time() - t0:.1f}s")


def test_kernels_lower_at_other_page_sizes_and_configs():
    pool = _SDS((8192, 32, 64, 64), FP8)
    pre = functools.partial(pp.prefill_attention_kernel, sm_scale=SM_SCALE, num_consumers=3, registers=(144, 80))
    _lower_for_h100(pre, _SDS((740, 32, 64), BF16), pool, pool, _SDS((2,), jnp.int32),
                    _SDS((1,), jnp.int32), _SDS((1, 32), jnp.int32), _SDS((1,), jnp.int32), _F32, _F32)
    for S in (16, 64, 128):  # several boxes per 64-row tile / one page a tile / several tiles per page
        pool = _SDS((1024, 32, S, 64), FP8)
        table = _SDS((8, 2048 // S), jnp.int32)
        dec = functools.partial(pm.decode_attention_kernel, sm_scale=SM_SCALE)
        _lower_for_h100(dec, _SDS((8, 32, 64), BF16), pool, pool, _SDS((8,), jnp.int32), table, _F32, _F32)
        assert pm.decode_tile_plan(32, 32, 128 // S, S) == (16, 8)  # the default at B=32, 128 tokens
        dec16 = functools.partial(pm.decode_attention_kernel, sm_scale=SM_SCALE)
        _lower_for_h100(dec16, _SDS((32, 32, 64), BF16), pool, pool, _SDS((32,), jnp.int32),
                        _SDS((32, 128 // S), jnp.int32), _F32, _F32)  # B=32 at 128 tokens
        dec64 = functools.partial(pm.decode_attention_kernel, sm_scale=SM_SCALE, tile_rows=64)
        _lower_for_h100(dec64, _SDS((32, 32, 64), BF16), pool, pool, _SDS((32,), jnp.int32),
                        _SDS((32, 128 // S), jnp.int32), _F32, _F32)
    pool = _SDS((1024, 32, 16, 64), FP8)
    pre = functools.partial(pp.prefill_attention_kernel, sm_scale=SM_SCALE)
    _lower_for_h100(pre, _SDS((740, 32, 64), BF16), pool, pool, _SDS((2,), jnp.int32),
                    _SDS((1,), jnp.int32), _SDS((1, 128), jnp.int32), _SDS((1,), jnp.int32), _F32, _F32)
    # 64-row warpgroups with and without ping-pong / in-place PV, and a short append (64 rows by default)
    pool = _SDS((1024, 32, 64, 64), FP8)
    cases: list[tuple[dict[str, Any], int]] = [
        ({"wg_rows": 64}, 740), ({"wg_rows": 64, "pingpong": False, "acc_in_place": False}, 740),
        ({"wg_rows": 128, "pingpong": False, "registers": (232, 40)}, 740), ({}, 10),
        # 128-key tiles: the default schedule (3 x 64 rows), 2 x 128 rows, 4 x 64 rows
        ({"block_k": 128}, 740), ({"wg_rows": 128, "block_k": 128, "registers": (216, 72)}, 740),
        ({"num_consumers": 4, "wg_rows": 64, "block_k": 128, "registers": (112, 32)}, 740),
        ({"num_consumers": 4, "wg_rows": 64}, 2964),  # the default multi-wave shape (four 64-row consumers)
    ]
    for kw, T in cases:
        pre = functools.partial(pp.prefill_attention_kernel, sm_scale=SM_SCALE, **kw)
        _lower_for_h100(pre, _SDS((T, 32, 64), BF16), pool, pool, _SDS((2,), jnp.int32),
                        _SDS((1,), jnp.int32), _SDS((1, 16), jnp.int32), _SDS((1,), jnp.int32), _F32, _F32)


def test_prefill_kernel_refuses_settings_that_would_hang_or_cannot_run():
    """setmaxnreg beyond the launch allocation would make the consumers wait forever; the
    interpreter has no register-fed wgmma; ping-pong pairs exactly two consumers."""
    pool = _SDS((64, 1, 16, 64), FP8)
    args = (_SDS((200, 1, 64), BF16), pool, pool, _SDS((2,), jnp.int32), _SDS((1,), jnp.int32),
            _SDS((1, 16), jnp.int32), _SDS((1,), jnp.int32), _F32, _F32)
    bad: list[dict[str, Any]] = [
           {"registers": (216, 80)},  # 2 x 216 + 80 = 512 > 3 x 168
           {"registers": (212, 72)},  # not a multiple of 8
           {"num_consumers": 3, "registers": (152, 80)},  # 3 x 152 + 80 = 536 > 4 x 128
           {"wg_rows": 96},
           {"block_k": 96},  # keys per tile: 64 or 128
           {"block_k": 256},
           {"num_consumers": 3, "pingpong": True},
           {"interpret": True, "acc_in_place": True},
           {"interpret": True, "p_in_registers": True}]
    for kw in bad:
        with pytest.raises(ValueError):
            jax.eval_shape(functools.partial(pp.prefill_attention_kernel, sm_scale=SM_SCALE, **kw), *args)
    jax.eval_shape(functools.partial(pp.prefill_attention_kernel, sm_scale=SM_SCALE, registers=(208, 88)), *args)


def test_split_merge_matches_the_two_pass_formula():
    """The unrolled merge equals max / exp2-weights / normalise, with empty (-inf) splits and
    rows whose every split is empty (output 0)."""
    rng = np.random.default_rng(int(time.time_ns() % 2**32))
    o = jnp.asarray(rng.normal(size=(3, 4, 9, 64)), jnp.float32)
    lse_np = rng.normal(size=(3, 4, 9)) * 40.0  # exp2 of these overflows without a max shift
    lse_np[0, 0, 2:] = -np.inf
    lse_np[1, 3, :] = -np.inf
    lse = jnp.asarray(lse_np, jnp.float32)
    top = jnp.max(lse, axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp2(lse - top)
    den = jnp.sum(w, axis=-1, keepdims=True)
    want = jnp.sum(o * w[..., None], axis=-2) / jnp.where(den > 0, den, 1.0)
    got = pm.merge_splits(o, lse)
    assert bool(jnp.all(jnp.isfinite(got)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert float(jnp.max(jnp.abs(got[1, 3]))) == 0.0
    got_bf16 = pm.merge_splits(o, lse, jnp.bfloat16)  # the kernel's output dtype, cast in the same fusion
    assert got_bf16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got_bf16.astype(jnp.float32)), np.asarray(want), rtol=1e-2, atol=1e-2)


def test_own_buffer_keeps_every_valid_value():
    """Kernel operands copied to aligned buffers keep their values: ids/slots/lengths (>= -1)
    and finite floats of any sign."""
    ints = jnp.asarray([-1, 0, 5, 2**30], jnp.int32)
    np.testing.assert_array_equal(np.asarray(pm.own_buffer(ints, jnp.int32)), np.asarray(ints))
    floats = jnp.asarray([-3.5, 0.0, 1e-30, 448.0], jnp.float32)
    np.testing.assert_array_equal(np.asarray(pm.own_buffer(floats, jnp.float32)), np.asarray(floats))
    bf = jnp.asarray([-2.0, 7.0], jnp.bfloat16)
    assert pm.own_buffer(bf, jnp.bfloat16).dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(pm.own_buffer(bf, jnp.bfloat16), np.float32), [-2.0, 7.0])


def test_prefill_schedule_by_size(monkeypatch: pytest.MonkeyPatch):
    """64-row consumers (three, else four) where their blocks fit one wave of CTAs (a 740-token image
    prefill: 4 x 32 = 128 CTAs), the multi-wave shape past it (four 64-row consumers; two 128-row
    ones with wide="2x128"), two 64-row ones for short prefills."""
    monkeypatch.delenv("KESTREL_JAX_PREFILL_WIDE", raising=False)
    expect = {10: (2, 64), 128: (2, 64), 129: (3, 64), 740: (3, 64), 768: (3, 64), 800: (4, 64),
              1024: (4, 64), 1025: (4, 64), 2048: (4, 64), 16 * 740: (4, 64)}
    for T, cfg in expect.items():
        assert pp.prefill_schedule(T, 32) == cfg, T
        assert pp.prefill_schedule(T, 32, wide="2x128") == (cfg if T <= 1024 else (2, 128)), T
    assert pp.prefill_schedule(740, 32, num_sms=100) == (4, 64)  # fewer SMs: 3 x 64 would take two waves
    assert pp.prefill_schedule(740, 32, num_sms=64, wide="2x128") == (2, 128)  # neither fits one wave


def test_prefill_wide_shape_switch(monkeypatch: pytest.MonkeyPatch):
    """KESTREL_JAX_PREFILL_WIDE picks the multi-wave shape (four 64-row consumers by default, two
    128-row ones for an A/B); one-wave sizes keep theirs; a value it does not know is refused."""
    monkeypatch.delenv("KESTREL_JAX_PREFILL_WIDE", raising=False)
    assert pp.prefill_schedule(16 * 740, 32) == (4, 64)
    monkeypatch.setenv("KESTREL_JAX_PREFILL_WIDE", "2x128")
    assert pp.prefill_schedule(16 * 740, 32) == (2, 128)
    assert pp.prefill_schedule(740, 32) == (3, 64) and pp.prefill_schedule(10, 32) == (2, 64)
    assert pp.prefill_schedule(16 * 740, 32, wide="4x64") == (4, 64)
    monkeypatch.setenv("KESTREL_JAX_PREFILL_WIDE", "8x32")
    with pytest.raises(ValueError, match="KESTREL_JAX_PREFILL_WIDE"):
        pp.prefill_schedule(16 * 740, 32)


def test_prefill_default_schedule_interpreted():
    """A size the schedule gives three 64-row consumers (130 tokens and a padding tail, one head):
    the default call matches the reference within the FP8 bound and leaves the tail zero."""
    rng = fresh_rng()
    segs = [(100, 0, 90), (30, 0, 0)]
    T, pad = sum(n for n, _, _ in segs), 6
    assert pp.prefill_schedule(T + pad, 1) == (3, 64)
    page = 64
    kvl = np.array([n + c for n, c, _ in segs], np.int32)
    max_pages = -(-int(kvl.max()) // page) + 1
    k_pages, v_pages, table, ks, vs = _make_pool(rng, len(segs) * max_pages + 2, 1, page, FP8, kvl, max_pages,
                                                 len(segs))
    cu = np.r_[0, np.cumsum([n for n, _, _ in segs])].astype(np.int32)
    q = jnp.asarray(rng.standard_normal((T + pad, 1, 64)), BF16)
    args = (q, k_pages, v_pages, jnp.asarray(cu), jnp.asarray(kvl), table,
            jnp.asarray([p for _, _, p in segs], jnp.int32), ks, vs)
    out = jax.jit(functools.partial(pp.prefill_attention_kernel, sm_scale=SM_SCALE, interpret=True))(*args)
    ref = _prefill_ref(*args, sm_scale=SM_SCALE)
    _check(out, ref, _vmax(v_pages, np.asarray(table), kvl, vs), atol=2.0**-10, what="prefill")
    assert not np.any(as_f32(out)[T:]), "padding rows must be zero"
