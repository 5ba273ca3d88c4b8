"""The decode QKV epilogue and split-KV attention in one Pallas Triton launch
(`qkv_attention_triton`, opt-in KESTREL_JAX_QKV_ATTENTION): interpreted on the CPU against
`decode_qkv_attention_ref` (the model's jnp path: `qkv_heads_ref`, `write_kv_ref`,
`decode_attention_ref`), cross-lowered for an H100 at MD2's decode shapes, and its refusals.

Bounds. With f32 QKV rows the only differences are float rounding (rotary's cos/sin, sums in another
order), so attention's output agrees within 1e-5 of its largest value and the written rows within
f32 rounding (FP8: the same code, but for values on a rounding boundary). With bf16 rows (the
model's) q and the new K/V are bf16 values that may land one bf16 step apart (rotary in another
order than XLA's), so the bounds are 2^-6 of the largest value. Every pool element not written is
bit-identical, pages past each sequence's length are poisoned (NaN) and must never reach a result,
and the page tables are scrambled.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType
from kernel_helpers import as_f32, fresh_rng

from kestrel_jax.pallas import qkv_attention_triton as qa

FP8 = jnp.float8_e4m3fn
BF16 = jnp.bfloat16
_SDS = jax.ShapeDtypeStruct


def _case(rng, lens, H, dh, pool_dtype, u_dtype, S, extra_cols=0, shared=0):
    """Rows with kv_lens `lens` (0: a padding row, slot -1) over disjoint scrambled pages (the first
    `shared` pages of rows 0 and 1 the same full pages, as a prefix cache shares them), their cached
    positions [0, L - 1) finite, everything else in the pools poisoned."""
    M = len(lens)
    maxp = max(1, max(-(-n // S) for n in lens)) + 1
    P = M * maxp + 3
    perm = rng.permutation(P)
    table = perm[:M * maxp].reshape(M, maxp).astype(np.int32)
    if shared and M > 1:
        table[1, :shared] = table[0, :shared]
    shape = (P, H, S, dh)
    if pool_dtype == FP8:  # random codes, NaN codes included
        pools = [np.asarray(rng.integers(0, 256, shape, dtype=np.uint8)).view(FP8) for _ in range(2)]
    else:
        pools = [np.where(rng.random(shape) < 0.2, np.nan, rng.standard_normal(shape)).astype(BF16)
                 for _ in range(2)]
    scales = [np.float32(rng.uniform(0.01, 0.05)) if pool_dtype == FP8 else np.float32(1.0) for _ in range(2)]
    slots = np.full(M, -1, np.int32)
    for i, n in enumerate(lens):
        for p in range(max(n - 1, 0)):  # the cached positions, as earlier steps wrote them
            page, row = table[i, p // S], p % S
            for pool, sc in zip(pools, scales, strict=True):
                vals = rng.standard_normal((H, dh)).astype(np.float32) / sc
                pool[page, :, row, :] = np.clip(vals, -448, 448).astype(pool.dtype)
        if n > 0:
            slots[i] = table[i, (n - 1) // S] * S + (n - 1) % S
    N = 3 * H * dh
    u = jnp.asarray(rng.standard_normal((M, N + extra_cols)) * 2.0, u_dtype)
    lens_a = np.asarray(lens, np.int32)
    positions = np.maximum(lens_a - 1, 0)
    return (u, jnp.asarray(positions), jnp.asarray(slots), *[jnp.asarray(p) for p in pools],
            *[jnp.asarray(s) for s in scales], jnp.asarray(lens_a), jnp.asarray(table))


def _bits(x: jax.Array) -> np.ndarray:
    return np.asarray(x.view(jnp.uint8) if x.dtype == FP8 else x.view(jnp.uint16))


def _check(got, want, old, slots, u_dtype, pool_dtype) -> None:
    (o, kp, vp), (o_r, kp_r, vp_r) = got, want
    o, o_r = as_f32(o), as_f32(o_r)
    assert np.isfinite(o).all()
    tight = jnp.dtype(u_dtype) == jnp.dtype(jnp.float32)
    scale = np.abs(o_r).max()
    np.testing.assert_allclose(o, o_r, rtol=0, atol=(1e-5 if tight else 2.0**-6) * scale)
    written = np.zeros(kp.shape[0] * kp.shape[2], bool)
    s = np.asarray(slots)
    written[s[s >= 0]] = True
    written = written.reshape(kp.shape[0], kp.shape[2])
    for new, ref, prev in ((kp, kp_r, old[0]), (vp, vp_r, old[1])):
        untouched = ~written[:, None, :, None] & np.ones(prev.shape, bool)
        np.testing.assert_array_equal(_bits(new)[untouched], _bits(prev)[untouched])
        a = as_f32(new).transpose(0, 2, 1, 3)[written]
        b = as_f32(ref).transpose(0, 2, 1, 3)[written]
        assert np.isfinite(a).all()
        if pool_dtype == FP8:  # one e4m3 step at most, and only a few codes
            assert (np.abs(a - b) <= 2.0**-3 * np.abs(b) + 2.0**-9).all()
            assert np.mean(a != b) <= (0.05 if tight else 0.2)
        else:
            np.testing.assert_allclose(a, b, rtol=0, atol=(0 if tight else 2.0**-6) * np.abs(b).max())


@pytest.mark.parametrize("lens,pool_dtype,u_dtype,S,splits,extra,shared", [
    ((150,), FP8, jnp.float32, 16, None, 0, 0),  # one row over ten pages, the default splits (16)
    ((1, 17, 65), BF16, jnp.float32, 16, 3, 0, 0),  # the new token alone; a page boundary each side
    ((33, 0, 96, 2), FP8, BF16, 32, 8, 0, 0),  # a padding row; more splits than tiles
    ((40, 40), BF16, BF16, 16, 2, 64, 2),  # a wider u (joined QKV + fc1); two full pages shared
])
def test_matches_the_reference(lens, pool_dtype, u_dtype, S, splits, extra, shared):
    rng = fresh_rng()
    H, dh, rot = 4, 64, 32
    u, pos, slots, kp, vp, ks, vs, kv_lens, table = _case(rng, lens, H, dh, pool_dtype, u_dtype, S, extra, shared)
    kw = dict(n_heads=H, rotary_dim=rot, theta=10000.0, sm_scale=dh**-0.5, u_cols=3 * H * dh if extra else None)
    got = qa.decode_qkv_attention_kernel(u, pos, slots, kp, vp, ks, vs, kv_lens, table, splits=splits,
                                         interpret=True, **kw)
    want = jax.jit(functools.partial(qa.decode_qkv_attention_ref, **kw))(u, pos, slots, kp, vp, ks, vs, kv_lens,
                                                                           table)
    _check(got, want, (kp, vp), slots, u_dtype, pool_dtype)
    assert got[0].dtype == u.dtype and got[0].shape == (len(lens), H, dh)
    if 0 in lens:  # an inactive row attends to nothing
        assert not np.asarray(as_f32(got[0]))[list(lens).index(0)].any()


def test_partials_of_empty_splits_and_the_split_choice():
    """Splits with no tiles write a zero output and -inf; the last split always holds the new token
    (a one-token sequence: every other split empty). The default split count fills ~4 programs per SM
    and never passes the table's tiles."""
    rng = fresh_rng()
    H, dh = 2, 64
    u, pos, slots, kp, vp, ks, vs, kv_lens, table = _case(rng, (1, 20), H, dh, FP8, jnp.float32, 16)
    o, lse, _, _ = qa.decode_qkv_attention_partials(u, pos, slots, kp, vp, ks, vs, kv_lens, table, n_heads=H,
                                                    rotary_dim=32, theta=10000.0, sm_scale=0.125, splits=4,
                                                    interpret=True)
    lse, o = np.asarray(lse), np.asarray(o)
    assert np.isneginf(lse[0, :, :3]).all() and np.isfinite(lse[0, :, 3]).all() and not o[0, :, :3].any()
    assert np.isfinite(lse[1, :, :2]).all() and np.isneginf(lse[1, :, 2]).all()  # 19 cached: 2 tiles of 4 splits
    assert np.isfinite(lse[1, :, 3]).all()  # the new token
    assert qa.default_splits(1, 32, 32) == 16 and qa.default_splits(8, 32, 32) == 2
    assert qa.default_splits(64, 32, 32) == 1 and qa.default_splits(1, 32, 3) == 2


def test_refusals():
    u = _SDS((1, 3 * 4 * 64), BF16)
    pool = _SDS((8, 4, 16, 64), FP8)
    table = _SDS((1, 4), jnp.int32)
    ok = dict(n_heads=4, rotary_dim=32)
    assert qa.qkv_attention_problem(u, pool, table, **ok) is None
    assert "grouped" in (qa.qkv_attention_problem(u, _SDS((8, 2, 16, 64), FP8), table, **ok) or "")
    assert "page size" in (qa.qkv_attention_problem(u, _SDS((8, 4, 12, 64), FP8), table, **ok) or "")
    assert "page size" in (qa.qkv_attention_problem(u, _SDS((8, 4, 256, 64), FP8), table, **ok) or "")
    assert "rotary_dim" in (qa.qkv_attention_problem(u, pool, table, n_heads=4, rotary_dim=24) or "")
    assert "pool dtype" in (qa.qkv_attention_problem(u, _SDS((8, 4, 16, 64), jnp.float32), table, **ok) or "")
    assert "u_cols" in (qa.qkv_attention_problem(u, pool, table, u_cols=9999, **ok) or "")
    with pytest.raises(ValueError, match="need M of each"):
        qa.decode_qkv_attention_partials(jnp.zeros((1, 768), BF16), jnp.zeros((2,), jnp.int32),
                                         jnp.zeros((2,), jnp.int32), jnp.zeros((8, 4, 16, 64), FP8),
                                         jnp.zeros((8, 4, 16, 64), FP8), 1.0, 1.0, jnp.zeros((2,), jnp.int32),
                                         jnp.zeros((2, 4), jnp.int32), n_heads=4, rotary_dim=32, theta=1e4,
                                         sm_scale=0.125, interpret=True)


def test_lowers_at_md2_decode_shapes():
    """One Triton launch for an H100 at MD2's shapes (32 heads, page 64, bf16 and FP8 pools, a
    2,048-token table), one and eight rows, the joined QKV + fc1 product read in place."""
    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    i32, f32 = jnp.int32, jnp.float32
    for M, pool_dtype, width in [(1, BF16, 14336), (8, BF16, 6144), (1, FP8, 6144)]:
        pool = _SDS((4824, 32, 64, 64), pool_dtype)

        def f(u, pos, slots, kp, vp, ks, vs, lens, table, cols=6144 if width != 6144 else None):
            return qa.decode_qkv_attention_kernel(u, pos, slots, kp, vp, ks, vs, lens, table, n_heads=32,
                                                  rotary_dim=32, theta=10000.0, sm_scale=0.125, u_cols=cols)
        with jax.sharding.use_abstract_mesh(mesh):
            text = jax.jit(f).trace(_SDS((M, width), BF16), _SDS((M,), i32), _SDS((M,), i32), pool, pool,
                                    _SDS((), f32), _SDS((), f32), _SDS((M,), i32),
                                    _SDS((M, 32), i32)).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text and "output_operand_alias" in text
