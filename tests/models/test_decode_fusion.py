"""The fused decode path of MoE layers on a GPU (the LayerNorm kernel's padded rows, the decode
GEMM's rows kernel, the QKV epilogue with the routing tables or the tau dots, the expert rows, the
opt-in residual + LayerNorm launch) computes the same hidden states as the reference path. The GPU
kernels it calls cannot run un-interpreted on the CPU, so each is replaced by a stand-in with the
same contract (the decode GEMM's split partials from a jnp product split in two, its finished rows
padded with NaN, per-(token, choice) expert rows from the reference MoE math, the attention
reference) or interpreted (the Triton LayerNorm and QKV epilogue kernels). What is tested is the
model's plumbing: padded rows handed from kernel to kernel and layer to layer, real-row slicing,
the last layer without a next LayerNorm.
"""

from __future__ import annotations

import sys
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kestrel_jax.models.config import tiny_config
from kestrel_jax.models.layers import gelu_erf
from kestrel_jax.models.moondream import random_model
from kestrel_jax.models.text import AttentionBatch, KVCache, MoE, TextModel, dense_proj_kernel
from kestrel_jax.pallas import decode_residual as dr
from kestrel_jax.pallas import gemv_mgpu, layer_norm_triton, moe_mgpu, ops
from kestrel_jax.pallas import paged_attention as pa
from kestrel_jax.pallas.moe import ExpertWeights, _expert_matrix, route_ref
from kestrel_jax.pallas.paged_attention import init_kv_pool

PAGES, PAGE, MAXP = 8, 64, 4
_prefetched: list[str] = []  # what the decode attention stand-in was handed to prefetch into L2


def _partials(x, w, w2=None, *, row0=False, **_):  # [2, N, Mp] f32 partials of y^T, K split in two
    ww = w if w2 is None else jnp.concatenate([w, w2], axis=1)
    mp = -(-x.shape[0] // 8) * 8
    xp = jnp.pad(x, ((0, mp - x.shape[0]), (0, 0))).astype(jnp.float32)
    h = x.shape[1] // 2
    parts = jnp.stack([(xp[:, :h] @ ww[:h].astype(jnp.float32)).T, (xp[:, h:] @ ww[h:].astype(jnp.float32)).T])
    return parts[:, :, 0] if row0 else parts  # `row0`: row 0's alone, [2, N]


_sides: list[tuple] = []  # the side products' x shapes (or merged partials) the expert rows stand-in was handed
_refuse_merged = False  # the expert rows stand-in leaves merged partials' side product to the caller


def _rows(x, router_w, router_b, experts: ExpertWeights, *, top_k, num_valid_tokens=None, logits=None, tokens=None,
          x_f16=None, route=None, side=None, side_row0=False):
    t = x.shape[0] if tokens is None else tokens
    xs = x[:t].astype(jnp.float32)
    if route is None:
        r = route_ref(x[:t], router_w, router_b, top_k)
        chosen, weights = r.experts, r.weights  # [T, k]
    else:  # the tables built in the QKV epilogue's launch
        chosen, weights = route.experts[:, :t].T, route.weights[:, :t].T
    up = _expert_matrix(experts.up_w, experts.up_scale, jnp.float32)[chosen]  # [T, k, 2I, D]
    down = _expert_matrix(experts.down_w, experts.down_scale, jnp.float32)[chosen]  # [T, k, D, I]
    hg = jnp.einsum("tkod,td->tko", up, xs)
    i = hg.shape[-1] // 2
    act = gelu_erf(hg[..., :i]) * (hg[..., i:] + 1.0)
    y = jnp.einsum("tkdi,tki->tkd", down, act).reshape(t * top_k, -1).astype(x.dtype)
    n = jnp.asarray(t if num_valid_tokens is None else num_valid_tokens, jnp.int32).reshape(1)
    parts = None
    if side is not None and isinstance(side[0], moe_mgpu.MergedRows):  # attention partials the up GEMM merges
        m = side[0]
        _sides.append(("merged", tuple(m.o.shape), m.rows))
        if not _refuse_merged:
            sx = jnp.pad(ops.merge_partials((m.o, m.lse), m.rows, jnp.float32), ((0, 8 - m.rows), (0, 0)))
            parts = _partials(sx, side[1], row0=side_row0)
    elif side is not None:  # the down GEMM's side product: [splits, N, Mp] partials of y^T
        _sides.append(tuple(side[0].shape))
        parts = _partials(*side, row0=side_row0)
    return dr.ExpertRows(y, jnp.arange(t * top_k, dtype=jnp.int32).reshape(t, top_k).T, weights.T, n, parts)


def _with_ln(rows):
    """A rows kernel stand-in `rows(x, w1, b1, w2, b2, **kw)` that also takes the kernel's `ln`
    (the LayerNorm inside it, on by default at one row): x normalised with `gemv_mgpu.ln_rows_ref`
    first, the normalised rows (padded with zeros) appended to what `rows` returns; with the
    kernel's `residual` too, x + the finished partials first (`gemv_mgpu.residual_row_ref`), that
    row appended last."""
    def call(x, w1, b1, w2=None, b2=None, *, ln=None, ln_eps=1e-5, residual=None, **kw):
        if ln is None:
            assert residual is None
            return rows(x, w1, b1, w2, b2, **kw)
        added = () if residual is None else (gemv_mgpu.residual_row_ref(x, *residual),)
        x = added[0] if added else x
        n = gemv_mgpu.ln_rows_ref(x, ln[0], ln[1], ln_eps)
        return (*rows(n[:x.shape[0]], w1, b1, w2, b2, **kw), n, *added)
    return call


@_with_ln
def _gemv_rows(x, w1, b1, w2=None, b2=None, **_):
    """Finished rows padded to the 8-row tile; the padding rows' products are NaN (the kernel's are
    its padding rows' products: no consumer may read them)."""
    mp = -(-x.shape[0] // 8) * 8
    out = []
    for w, b in ((w1, b1),) if w2 is None else ((w1, b1), (w2, b2)):
        y = (x.astype(jnp.float32) @ w.astype(jnp.float32)).astype(x.dtype)
        y = y if b is None else y + b
        out.append(jnp.concatenate([y, jnp.full((mp - x.shape[0], w.shape[1]), jnp.nan, y.dtype)]))
    return tuple(out)


@pytest.fixture()
def stand_ins(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    monkeypatch.setattr(gemv_mgpu, "gemv_partials", _partials)
    monkeypatch.setattr(gemv_mgpu, "gemv_rows", _gemv_rows)
    monkeypatch.setattr(gemv_mgpu, "gemv_supported", lambda x, w: x.shape[0] <= 64)
    monkeypatch.setenv("KESTREL_JAX_DECODE_QKV_KERNEL", "0")
    # MoE layers add their residual in XLA (or the opt-in residual + LayerNorm launch): the MoE
    # residual in the next rows kernel, on by default, is tested where it is switched on
    # (tests/models/test_dense_residual_in_rows.py)
    monkeypatch.setenv("KESTREL_JAX_MOE_RESIDUAL_IN_ROWS", "0")
    _prefetched.clear()
    _sides.clear()

    def attention(q, kp, vp, lens, table, ks, vs, *, sm_scale, prefetch=(), prefetch_experts=(),
                  prefetch_max_blocks=8):
        # the L2 prefetch targets it was handed, recorded by shape (the reference ignores them)
        _prefetched.extend(f"weight {tuple(w.shape)}" for w in prefetch)
        _prefetched.extend(f"experts {tuple(w.shape)} {tuple(meta.shape)} {prefetch_max_blocks}"
                           for w, meta in prefetch_experts)
        return pa.decode_attention_ref(q, kp, vp, lens, table, ks, vs, sm_scale=sm_scale)

    monkeypatch.setattr(ops, "decode_attention", attention)
    # no split partials (the merge in the up GEMM's launch, on by default, has a stand-in of its own
    # in test_merge_in_up_switch): the layers call the attention stand-in above
    monkeypatch.setattr(ops, "decode_attention_partials", lambda *args, **kw: None)

    def projected(q, kp, vp, lens, table, ks, vs, w, b, *, sm_scale, max_rows, **pf):
        # attention + its projection in one call where the merged-projection switch is on
        if not ops.merged_projection_wanted() or q.shape[0] > max_rows:
            return None
        calls.append("attention+projection")
        o = attention(q, kp, vp, lens, table, ks, vs, sm_scale=sm_scale, **pf).reshape(q.shape[0], -1)
        return o @ w + (0 if b is None else b)

    monkeypatch.setattr(ops, "decode_attention_projected", projected)
    monkeypatch.setattr(ops, "moe_layer_rows", _rows)
    def interpreted(real, label):  # the kernel interpreted, its call recorded
        def call(*args, **kw):
            calls.append(label)
            return real(*args, **kw, interpret=True)
        return call

    for name, label in (("layer_norm_rows_kernel", "layernorm"),
                        ("residual_layer_norm_rows_kernel", "residual+layernorm")):
        monkeypatch.setattr(layer_norm_triton, name, interpreted(getattr(layer_norm_triton, name), label))
    ops._jitted.cache_clear()
    return calls


def _f32_decode_case(cfg, t: int, rng: np.random.Generator) -> tuple:
    """(x, batch, cache): t decode rows of float32 inputs over a filled random cache (random K/V in
    every page), each row its own scrambled page table."""
    pool = init_kv_pool(cfg.n_layers, PAGES, PAGE, cfg.n_kv_heads, cfg.head_dim, jnp.float32)
    cache = KVCache(tuple(jnp.asarray(rng.standard_normal(k.shape), jnp.float32) for k, _ in pool),
                    tuple(jnp.asarray(rng.standard_normal(v.shape), jnp.float32) for _, v in pool),
                    jnp.ones(cfg.n_layers), jnp.ones(cfg.n_layers))
    x = jnp.asarray(rng.standard_normal((t, cfg.dim)), jnp.float32)
    positions = jnp.asarray(rng.integers(10, 150, t), jnp.int32)
    table = jnp.asarray(np.stack([rng.permutation(PAGES)[:MAXP] for _ in range(t)]), jnp.int32)
    slots = table[jnp.arange(t), positions // PAGE] * PAGE + positions % PAGE
    return x, AttentionBatch(positions, slots, positions + 1, table), cache


def test_fused_decode_matches_the_reference_path(stand_ins: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """One decode row, float32 weights, each layer its own LayerNorm; with the opt-in residual +
    LayerNorm launch a MoE layer followed by another ends in `ops.decode_residual_layer_norm`."""
    t = 1
    monkeypatch.setenv("KESTREL_JAX_RESIDUAL_LN", "1")
    model = random_model(tiny_config("md3"), dtype=jnp.float32, std=0.05).text
    cfg = model.cfg
    rng = np.random.default_rng(t)
    for block in model.blocks:  # each layer its own LayerNorm: a handoff to the wrong layer shows
        block.ln.scale.set_value(jnp.asarray(rng.uniform(0.5, 1.5, cfg.dim), jnp.float32))
        block.ln.bias.set_value(jnp.asarray(rng.standard_normal(cfg.dim) * 0.1, jnp.float32))
    x, batch, cache = _f32_decode_case(cfg, t, rng)
    with ops.use_backend("reference"):
        want, _, _ = model(x, batch, cache)
    with ops.use_backend("kernel"):
        got, _, _ = model(x, batch, cache)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    # the dense layers' one-row LayerNorm on the same kernel (`ops.decode_dense_layer_norm`); the
    # first MoE layer normalises its own input; the others get it from the previous layer's
    # residual + LayerNorm kernel (the last layer ends in XLA's residual: no next LayerNorm)
    assert stand_ins == ["layernorm"] * (cfg.n_layers - moe_layers + 1) + ["residual+layernorm"] * (moe_layers - 1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("t", [1, 3])
def test_projection_in_the_down_gemm_switch(stand_ins: list[str], monkeypatch: pytest.MonkeyPatch, t: int) -> None:
    """KESTREL_JAX_PROJ_IN_DOWN (on by default): each MoE layer hands its attention output, padded
    to 8 rows, and its projection weight to the expert rows call (the down GEMM's side product) and
    adds the projection from the partials that come back; the hidden states match the reference
    path. Off, nothing is handed over."""
    model = random_model(tiny_config("md3"), dtype=jnp.float32, std=0.05).text
    cfg = model.cfg
    x, batch, cache = _f32_decode_case(cfg, t, np.random.default_rng(11 + t))
    with ops.use_backend("reference"):
        want, _, _ = model(x, batch, cache)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    for switch, expect in (("0", 0), (None, moe_layers)):
        if switch is None:
            monkeypatch.delenv("KESTREL_JAX_PROJ_IN_DOWN", raising=False)
        else:
            monkeypatch.setenv("KESTREL_JAX_PROJ_IN_DOWN", switch)
        _sides.clear()
        ops._jitted.cache_clear()
        with ops.use_backend("kernel"):
            got, _, _ = model(x, batch, cache)
        assert _sides == [(8, cfg.dim)] * expect, switch
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("refused", [False, True], ids=["merged-in-up", "left-to-the-model"])
def test_merge_in_up_switch(stand_ins: list[str], monkeypatch: pytest.MonkeyPatch, refused: bool) -> None:
    """KESTREL_JAX_MERGE_IN_UP (on by default): each MoE layer takes decode attention's unmerged split
    partials (the stand-in: the reference output as one split, a second split of 7s with lse -inf,
    NaN padding rows) and hands them as `MergedRows` to the expert rows call, whose up GEMM merges
    them for the projection's side product; where that call leaves the side product to the caller
    the model merges them itself (`ops.merge_partials`) and projects. The hidden states match the
    reference path either way; dense layers and =0 take no partials."""
    global _refuse_merged
    model = random_model(tiny_config("md3"), dtype=jnp.float32, std=0.05).text
    cfg = model.cfg
    t = 2
    x, batch, cache = _f32_decode_case(cfg, t, np.random.default_rng(5))
    with ops.use_backend("reference"):
        want, _, _ = model(x, batch, cache)
    asked: list[int] = []

    def partials(q, kp, vp, lens, table, ks, vs, *, sm_scale, **_):
        asked.append(q.shape[0])
        o = pa.decode_attention_ref(q, kp, vp, lens, table, ks, vs, sm_scale=sm_scale).astype(jnp.float32)
        o8 = jnp.full((8, q.shape[1], 2, q.shape[2]), jnp.nan, jnp.float32).at[:t, :, 0].set(o).at[:t, :, 1].set(7.0)
        lse = jnp.full((8, q.shape[1], 2), jnp.nan, jnp.float32).at[:t, :, 0].set(0.0).at[:t, :, 1].set(-jnp.inf)
        return o8, lse

    monkeypatch.setattr(ops, "decode_attention_partials", partials)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    monkeypatch.setattr(sys.modules[__name__], "_refuse_merged", refused)
    for switch, expect in (("0", [(8, cfg.dim)] * moe_layers),
                           (None, [("merged", (8, cfg.n_heads, 2, cfg.head_dim), t)] * moe_layers)):
        if switch is None:
            monkeypatch.delenv("KESTREL_JAX_MERGE_IN_UP", raising=False)
        else:
            monkeypatch.setenv("KESTREL_JAX_MERGE_IN_UP", switch)
        _sides.clear()
        asked.clear()
        ops._jitted.cache_clear()
        with ops.use_backend("kernel"):
            got, _, _ = model(x, batch, cache)
        assert _sides == expect, switch
        assert asked == ([t] * moe_layers if switch is None else [])
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-4)


def test_residual_layer_norm_switch(stand_ins: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """By default each decode MoE layer runs its own LayerNorm kernel and XLA forms the residual;
    with KESTREL_JAX_RESIDUAL_LN=1 a MoE layer followed by another ends in the residual +
    LayerNorm kernel."""
    monkeypatch.delenv("KESTREL_JAX_RESIDUAL_LN", raising=False)
    model = random_model(tiny_config("md3"), dtype=jnp.float32).text
    cfg = model.cfg
    pool = init_kv_pool(cfg.n_layers, PAGES, PAGE, cfg.n_kv_heads, cfg.head_dim, jnp.float32)
    cache = KVCache(tuple(k for k, _ in pool), tuple(v for _, v in pool), jnp.ones(cfg.n_layers),
                    jnp.ones(cfg.n_layers))
    table = jnp.arange(MAXP, dtype=jnp.int32)[None]
    batch = AttentionBatch(jnp.array([3], jnp.int32), jnp.array([3], jnp.int32), jnp.array([4], jnp.int32), table)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    dense = ["layernorm"] * (cfg.n_layers - moe_layers)  # the dense layers' one-row LayerNorm kernel
    for switch, want in ((None, dense + ["layernorm"] * moe_layers),  # no residual kernel: each layer's
                         ("1", dense + ["layernorm"] + ["residual+layernorm"] * (moe_layers - 1))):
        if switch is not None:
            monkeypatch.setenv("KESTREL_JAX_RESIDUAL_LN", switch)
        stand_ins.clear()
        with ops.use_backend("kernel"):  # traced only: the numbers are test_fused_decode_matches_the_reference_path's
            jax.eval_shape(lambda: model(jnp.ones((1, cfg.dim), jnp.float32), batch, cache))
        assert stand_ins == want, switch
    monkeypatch.setenv("KESTREL_JAX_RESIDUAL_LN", "2")
    with ops.use_backend("kernel"), pytest.raises(ValueError, match="KESTREL_JAX_RESIDUAL_LN"):
        jax.eval_shape(lambda: model(jnp.ones((1, cfg.dim), jnp.float32), batch, cache))


def interpret_epilogue(monkeypatch: pytest.MonkeyPatch) -> None:
    """The QKV epilogue's Triton kernels (with and without the routing program) run interpreted."""
    from kestrel_jax.pallas import qkv_epilogue

    for name in ("decode_qkv_kernel", "decode_qkv_route_kernel"):
        real = getattr(qkv_epilogue, name)
        monkeypatch.setattr(qkv_epilogue, name, lambda *a, _real=real, **kw: _real(*a, **kw, interpret=True))


def _bf16_decode_case(seed: int, family: Literal["md2", "md3"] = "md3") -> tuple:
    """The tiny MD3 (or `family`'s) text model in bf16, one decode row at position 100 over a filled
    random cache."""
    model = random_model(tiny_config(family), dtype=jnp.bfloat16, std=0.05).text
    cfg = model.cfg
    rng = np.random.default_rng(seed)
    pool = init_kv_pool(cfg.n_layers, PAGES, PAGE, cfg.n_kv_heads, cfg.head_dim, jnp.bfloat16)
    cache = KVCache(tuple(jnp.asarray(rng.standard_normal(k.shape), jnp.bfloat16) for k, _ in pool),
                    tuple(jnp.asarray(rng.standard_normal(v.shape), jnp.bfloat16) for _, v in pool),
                    jnp.ones(cfg.n_layers), jnp.ones(cfg.n_layers))
    x = jnp.asarray(rng.standard_normal((1, cfg.dim)), jnp.bfloat16)
    table = jnp.asarray(rng.permutation(PAGES)[:MAXP], jnp.int32)[None]
    positions = jnp.array([100], jnp.int32)
    batch = AttentionBatch(positions, table[0, 1:2] * PAGE + 100 % PAGE, positions + 1, table)
    return model, x, batch, cache


def test_padded_qkv_rows_reach_the_epilogue_and_router_unsliced(stand_ins: list[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The default decode path with the decode GEMM's rows kernel (`gemv_mgpu.gemv_rows`): its
    outputs come padded to the row tile and go to the QKV epilogue kernel (interpreted here) as
    they are. A stand-in fills the padding rows with NaN: the hidden states stay finite and match
    the reference path within bf16 rounding; with `KESTREL_JAX_GEMV_ROWS=0` it is not called."""

    monkeypatch.delenv("KESTREL_JAX_DECODE_QKV_KERNEL")
    calls: list[tuple[int, ...]] = []

    def rows(x, w1, b1, w2=None, b2=None, **kw):
        out = _gemv_rows(x, w1, b1, w2, b2, **kw)
        calls.append(tuple(o.shape[0] for o in out))
        return out

    monkeypatch.setattr(gemv_mgpu, "gemv_rows", rows)
    interpret_epilogue(monkeypatch)
    model, x, batch, cache = _bf16_decode_case(7)
    with ops.use_backend("reference"):
        want = np.asarray(model(x, batch, cache)[0].astype(jnp.float32))
    monkeypatch.setenv("KESTREL_JAX_GEMV_ROWS", "1")
    ops._jitted.cache_clear()
    with ops.use_backend("kernel"):
        got = np.asarray(model(x, batch, cache)[0].astype(jnp.float32))
    # traced once (the MoE layers share one jitted call): QKV, router and the LayerNorm's rows
    assert calls == [(8, 8, 8)]
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() <= 2.0**-6 * np.abs(want).max()
    monkeypatch.setenv("KESTREL_JAX_GEMV_ROWS", "0")
    ops._jitted.cache_clear()
    with ops.use_backend("kernel"):
        jax.eval_shape(lambda: model(x, batch, cache))  # traced only: the switch keeps the pair kernel
    assert calls == [(8, 8, 8)]


def test_tau_dots_from_the_qkv_gemm_reach_the_epilogue(stand_ins: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """By default (KESTREL_JAX_TAU_DOTS=1) an MoE layer's decode QKV GEMM also forms MD3's tau dot
    products (`gemv_rows(tau_w=...)`; a stand-in here with per-64-column-block shares from
    `tau_dots_ref`, NaN in the padding rows) and the QKV epilogue (interpreted) forms tau from them
    instead of from the whole row: the hidden states match the reference path within bf16 rounding
    with the switch on and off, and the epilogue gets the dots only with it on. (The real kernel
    takes 32 heads only; the tiny model's 4 pass its shape check here.)"""
    from kestrel_jax.pallas import qkv_epilogue

    monkeypatch.delenv("KESTREL_JAX_DECODE_QKV_KERNEL")
    got_dots: list[bool] = []

    @_with_ln
    def rows(x, w1, b1, w2=None, b2=None, *, tau_w=None, **_):
        out = _gemv_rows(x, w1, b1, w2, b2)
        if tau_w is None:
            return out
        u = out[0]
        shares = [gemv_mgpu.tau_dots_ref(u[:, c:c + 64], tau_w[0][:, c:c + 64], tau_w[1][:, c:c + 64])
                  for c in range(0, u.shape[1], 64)]
        return (*out, jnp.stack(shares))

    def epilogue(*a, **kw):
        got_dots.append(kw.get("tau_dots") is not None)
        return real(*a, **kw, interpret=True)

    real = qkv_epilogue.decode_qkv_route_kernel
    monkeypatch.setattr(gemv_mgpu, "gemv_rows", rows)
    monkeypatch.setattr(gemv_mgpu, "tau_dots_problem", lambda *a: None)
    monkeypatch.setattr(qkv_epilogue, "decode_qkv_route_kernel", epilogue)
    real_plain = qkv_epilogue.decode_qkv_kernel
    monkeypatch.setattr(qkv_epilogue, "decode_qkv_kernel", lambda *a, **kw: real_plain(*a, **kw, interpret=True))
    model, x, batch, cache = _bf16_decode_case(5)
    with ops.use_backend("reference"):
        want = np.asarray(model(x, batch, cache)[0].astype(jnp.float32))
    moe_layers = sum(model.cfg.is_moe_layer(i) for i in range(model.cfg.n_layers))
    monkeypatch.setenv("KESTREL_JAX_TAU_DOTS", "1")
    ops._jitted.cache_clear()
    with ops.use_backend("kernel"):
        got = np.asarray(model(x, batch, cache)[0].astype(jnp.float32))
    assert got_dots == [True] * moe_layers
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() <= 2.0**-6 * np.abs(want).max()
    # switched off: traced only (that path's numbers: test_padded_qkv_rows_reach_the_epilogue_and_router_unsliced)
    monkeypatch.setenv("KESTREL_JAX_TAU_DOTS", "0")
    ops._jitted.cache_clear()
    got_dots.clear()
    with ops.use_backend("kernel"):
        jax.eval_shape(lambda: model(x, batch, cache))
    assert got_dots == [False] * moe_layers
    monkeypatch.setenv("KESTREL_JAX_TAU_DOTS", "2")
    with ops.use_backend("kernel"), pytest.raises(ValueError, match="KESTREL_JAX_TAU_DOTS"):
        ops.tau_dots_wanted()


def test_routing_tables_built_in_the_qkv_epilogue_reach_the_moe(stand_ins: list[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """KESTREL_JAX_ROUTE_IN_QKV=1: each decode MoE layer's QKV epilogue launch (interpreted) also
    builds the routing tables from the router logits of the same decode GEMM launch, and the MoE
    receives them instead of routing itself. A stand-in for the expert rows routes from whatever it
    gets (the tables it is handed, else `route_tables` on the logits, interpreted), so the hidden
    states agree bit for bit with the switch off only if the epilogue's tables are the tables
    program's and reach the right layer; the stand-in records which it got."""
    from kestrel_jax.pallas import moe_route_triton

    monkeypatch.delenv("KESTREL_JAX_DECODE_QKV_KERNEL")
    got_route: list[bool] = []

    @_with_ln
    def gemv_rows(x, w1, b1, w2=None, b2=None, **_):
        mp = -(-x.shape[0] // 8) * 8
        xp = jnp.pad(x, ((0, mp - x.shape[0]), (0, 0))).astype(jnp.float32)
        return tuple((xp @ w.astype(jnp.float32)).astype(x.dtype) + (0 if b is None else b)
                     for w, b in (((w1, b1),) if w2 is None else ((w1, b1), (w2, b2))))

    def rows(x, router_w, router_b, experts: ExpertWeights, *, top_k, num_valid_tokens=None, logits=None,
             tokens=None, x_f16=None, route=None, side=None):
        t = x.shape[0] if tokens is None else tokens
        got_route.append(route is not None)
        if route is None:
            n = jnp.asarray(t if num_valid_tokens is None else num_valid_tokens, jnp.int32).reshape(1)
            route = moe_route_triton.route_tables(logits, n, top_k=top_k, block_tokens=logits.shape[0],
                                                  interpret=True)
        experts_t, weights_t = route.experts[:, :t].T, route.weights[:, :t].T  # [t, k]
        xs = x[:t].astype(jnp.float32)
        up = _expert_matrix(experts.up_w, experts.up_scale, jnp.float32)[experts_t]
        down = _expert_matrix(experts.down_w, experts.down_scale, jnp.float32)[experts_t]
        hg = jnp.einsum("tkod,td->tko", up, xs)
        i = hg.shape[-1] // 2
        y = jnp.einsum("tkdi,tki->tkd", down, gelu_erf(hg[..., :i]) * (hg[..., i:] + 1.0))
        n = jnp.asarray(t, jnp.int32).reshape(1)
        # (no side partials even where handed a side product: the layer then projects on its own)
        return dr.ExpertRows(y.reshape(t * top_k, -1).astype(x.dtype),
                             jnp.arange(t * top_k, dtype=jnp.int32).reshape(t, top_k).T, weights_t.T, n)

    monkeypatch.setattr(gemv_mgpu, "gemv_rows", gemv_rows)
    monkeypatch.setattr(ops, "moe_layer_rows", rows)
    interpret_epilogue(monkeypatch)
    model, x, batch, cache = _bf16_decode_case(11)
    cfg = model.cfg
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    out = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("KESTREL_JAX_ROUTE_IN_QKV", switch)
        ops._jitted.cache_clear()
        got_route.clear()
        with ops.use_backend("kernel"):
            out[switch] = np.asarray(model(x, batch, cache)[0].astype(jnp.float32))
        assert got_route == [switch == "1"] * moe_layers, switch
    assert np.isfinite(out["1"]).all()
    np.testing.assert_array_equal(out["1"], out["0"])
    # KESTREL_JAX_L2_PREFETCH: decode attention is handed the output projection's weight (bit 1,
    # every layer) and, where the epilogue built the routing tables, the up experts with them (bit 2;
    # the default, 14, asks for the up experts only), with 16 the down experts too
    proj = f"weight {(cfg.dim, cfg.dim)}"
    moe = next(b.mlp for b in model.blocks if isinstance(b.mlp, MoE))
    e = moe.fc1[...].shape[0]  # at most top_k blocks at one row
    up = f"experts {tuple(moe.fc1[...].shape)} (1, 3, {e}) {moe.top_k}"
    down = f"experts {tuple(moe.fc2[...].shape)} (1, 3, {e}) {moe.top_k}"
    assert _prefetched == [up] * moe_layers  # the last run above, at the default
    for mask, want in (("0", []), ("1", [proj] * cfg.n_layers), ("2", [up] * moe_layers),
                       ("3", [proj] * cfg.n_layers + [up] * moe_layers), ("30", [up, down] * moe_layers),
                       ("16", [])):
        monkeypatch.setenv("KESTREL_JAX_L2_PREFETCH", mask)
        ops._jitted.cache_clear()
        _prefetched.clear()
        with ops.use_backend("kernel"):
            got = np.asarray(model(x, batch, cache)[0].astype(jnp.float32))
        assert sorted(_prefetched) == sorted(want), mask
        np.testing.assert_array_equal(got, out["1"])
    monkeypatch.setenv("KESTREL_JAX_L2_PREFETCH", "32")
    with pytest.raises(ValueError, match="KESTREL_JAX_L2_PREFETCH"):
        ops.l2_prefetch_mask()
    monkeypatch.setenv("KESTREL_JAX_ROUTE_IN_QKV", "2")
    with ops.use_backend("kernel"), pytest.raises(ValueError, match="KESTREL_JAX_ROUTE_IN_QKV"):
        ops.route_in_qkv_wanted()


def test_merged_projection_switch(stand_ins: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """KESTREL_JAX_MERGED_PROJ=1: every layer's decode attention and output projection come from
    `ops.decode_attention_projected` (a stand-in of the same contract here), MoE and dense layers
    alike (the dense projection is on the decode GEMM by default), and the hidden states match the
    reference path; off (the default), it is never reached."""
    model = random_model(tiny_config("md3"), dtype=jnp.float32, std=0.05).text
    cfg = model.cfg
    x, batch, cache = _f32_decode_case(cfg, 1, np.random.default_rng(5))
    with ops.use_backend("reference"):
        want, _, _ = model(x, batch, cache)
    for switch, expect in (("0", 0), ("1", cfg.n_layers)):
        monkeypatch.setenv("KESTREL_JAX_MERGED_PROJ", switch)
        stand_ins.clear()
        ops._jitted.cache_clear()
        with ops.use_backend("kernel"):
            got, _, _ = model(x, batch, cache)
        assert stand_ins.count("attention+projection") == expect, switch
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-4)


def test_dense_layers_project_through_the_decode_gemm_unless_switched_off(stand_ins: list[str],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """KESTREL_JAX_DENSE_PROJ_GEMV=1 (the default): MD2's dense layers run their decode output
    projection (one row: XLA's two-row GEMM otherwise) through the decode GEMM kernel (a stand-in
    of the same contract here) and the hidden states match the reference path; off, they never
    reach it."""
    t = 1
    model = TextModel(tiny_config("md2").text, dtype=jnp.float32, rngs=nnx.Rngs(t))
    cfg = model.cfg
    x, batch, cache = _f32_decode_case(cfg, t, np.random.default_rng(t))
    shapes: list[tuple[int, ...]] = []

    def partials(x, w, *a, **kw):
        shapes.append(w.shape)
        return _partials(x, w)

    monkeypatch.setattr(gemv_mgpu, "gemv_partials", partials)
    with ops.use_backend("reference"):
        want, _, _ = model(x, batch, cache)
    for switch, expect in (("0", []), ("1", [(cfg.dim, cfg.dim)])):
        monkeypatch.setenv("KESTREL_JAX_DENSE_PROJ_GEMV", switch)
        shapes.clear()
        ops._jitted.cache_clear()
        jax.clear_caches()
        with ops.use_backend("kernel"):
            got, _, _ = model(x, batch, cache)
        assert shapes == expect, switch  # traced once: the layers share one jitted call
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-4)
    monkeypatch.setenv("KESTREL_JAX_DENSE_PROJ_GEMV", "2")
    with pytest.raises(ValueError, match="KESTREL_JAX_DENSE_PROJ_GEMV"):
        dense_proj_kernel()
    monkeypatch.delenv("KESTREL_JAX_DENSE_PROJ_GEMV")
    assert dense_proj_kernel()
