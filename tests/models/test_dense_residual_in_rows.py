"""The model's plumbing of KESTREL_JAX_DENSE_RESIDUAL_IN_ROWS: at one row a dense layer followed by
another dense layer leaves its residual add to that layer's rows kernel (`Block.dense_decode_out_pending`,
`ops.dense_out_row0`, `ops.decode_ln_dense_in`'s residual); the last dense layer before an MoE
layer, and the last layer, add in XLA; and of KESTREL_JAX_MOE_RESIDUAL_IN_ROWS (on by default), the same
between MoE layers (`ops.decode_ln_qkv_router`'s residual). The kernels are the stand-ins of
tests/models/test_decode_fusion.py (the kernels themselves: tests/pallas/test_gemv_residual.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_decode_fusion import _partials, stand_ins  # noqa: F401 (a fixture)
from test_ln_in_rows import _case, _kernel_forward

from kestrel_jax.pallas import gemv_mgpu, ops

NAME = "KESTREL_JAX_DENSE_RESIDUAL_IN_ROWS"


def _count_xla_adds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """`ops.add_residual` (the model's add of a pending residual in XLA) wrapped: one entry a call."""
    counted: list[int] = []
    real = ops.add_residual

    def counting(r: ops.PendingResidual) -> jax.Array:
        counted.append(1)
        return real(r)

    monkeypatch.setattr(ops, "add_residual", counting)
    return counted


@pytest.mark.parametrize("family", ["md2", "md3"])
def test_dense_layers_add_the_residual_in_the_next_rows_kernel(stand_ins: list[str],  # noqa: F811
                                                               monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    """On, with joined weights: every dense layer whose next layer is dense hands its output
    product's row-0 partials [S, D] (the stand-in's S = 2) and summed bias to that layer's rows
    kernel, which returns the new residual row; the hidden states lie within bf16 rounding of the
    switch off and of the reference path. (Not bit for bit: the stand-ins finish the partials with
    XLA's ops, and XLA, allowed excess precision by default, may hand the LayerNorm fused after the
    residual add its f32 sum instead of the bf16 row; with XLA_FLAGS=--xla_allow_excess_precision=false
    on and off agree bit for bit. The kernel rounds the row as the reference does:
    tests/pallas/test_gemv_residual.py.) MD2's tiny model (four dense layers) hands on
    three times, MD3's (two dense, then MoE) once. On is the default; off (0), or without joined
    weights, no row-0 partials are asked for and the rows kernel gets no residual."""
    rows_calls: list[tuple] = []
    row0: list[tuple] = []

    def partials(x, w, w2=None, **kw):
        if kw.get("row0"):
            row0.append((x.shape, w.shape, kw.get("splits")))
        return _partials(x, w, w2, **kw)

    monkeypatch.setattr(gemv_mgpu, "gemv_partials", partials)
    model, x1, batch1, cache, want = _case(monkeypatch, rows_calls, 11, family)
    cfg = model.cfg
    dense = [not cfg.is_moe_layer(i) for i in range(cfg.n_layers)]
    handed = sum(dense[i] and dense[i + 1] for i in range(cfg.n_layers - 1))
    assert handed == (3 if family == "md2" else 1)
    joined = cfg.n_heads * cfg.head_dim + 2 * cfg.n_kv_heads * cfg.head_dim + cfg.ff_dim
    splits = ops.dense_out_splits(cfg.dim + cfg.ff_dim, one_row=True)
    forward = functools.partial(_kernel_forward, model, x1, batch1, cache, monkeypatch, NAME)
    outs = {}
    counted = _count_xla_adds(monkeypatch)
    # (each kernel variant is traced once, the first time: the layers and later forwards share the trace)
    for fused, switch in ((True, "0"), (False, None), (True, None)):
        model.fuse_dense_decode(fused)
        got = forward(switch, rows_calls, row0, stand_ins)
        on = fused and switch != "0"
        # traced once each (the layers share the jitted calls): with and without the residual
        residual_call = (1, joined, True, ((2, cfg.dim), True))  # the stand-in's two K halves
        assert (residual_call in rows_calls) == on, (fused, switch)
        assert all(len(c) == 3 for c in rows_calls if c != residual_call)
        assert row0 == ([((1, cfg.dim + cfg.ff_dim), (cfg.dim + cfg.ff_dim, cfg.dim), splits)] if on else [])
        assert counted == [], "every pending residual was added in a rows kernel"
        assert np.isfinite(got).all()
        assert np.abs(got - want).max() <= 2.0**-6 * np.abs(want).max(), (fused, switch)
        outs[(fused, switch)] = got
    on, off = outs[(True, None)], outs[(True, "0")]
    assert np.abs(on - off).max() <= 2.0**-6 * np.abs(off).max()
    model.fuse_dense_decode(False)


@pytest.mark.parametrize("family,name,op,handed", [
    ("md2", NAME, "decode_ln_dense_in", 3),  # MD2's tiny model: three dense layers hand on
    ("md3", "KESTREL_JAX_MOE_RESIDUAL_IN_ROWS", "decode_ln_qkv_router", 1),  # MD3's: layer 2 to layer 3
])
def test_a_refused_residual_is_added_in_xla(stand_ins: list[str], monkeypatch: pytest.MonkeyPatch,  # noqa: F811
                                            family: str, name: str, op: str, handed: int) -> None:
    """Where the next rows kernel refuses the residual (`ops.decode_ln_dense_in` or, between MoE
    layers, `ops.decode_ln_qkv_router` None with it), the model adds it in XLA (`ops.add_residual`;
    an MoE layer's: x + the projection's row-0 partials finished + the expert rows' weighted sum),
    once per hand-on, and runs the rows kernel on the new row: within bf16 rounding of the switch
    off and of the reference path."""
    rows_calls: list[tuple] = []
    model, x1, batch1, cache, want = _case(monkeypatch, rows_calls, 12, family)
    model.fuse_dense_decode(True)
    if name != NAME:  # MD3: its dense layers' hand-on off, so that every residual counted is the MoE's
        monkeypatch.setenv(NAME, "0")
    off = _kernel_forward(model, x1, batch1, cache, monkeypatch, name, "0", rows_calls)
    real = getattr(ops, op)
    monkeypatch.setattr(ops, op, lambda *a, residual=None, **kw: None if residual is not None else real(*a, **kw))
    counted = _count_xla_adds(monkeypatch)
    got = _kernel_forward(model, x1, batch1, cache, monkeypatch, name, "1", rows_calls)
    assert len(counted) == handed
    assert all(len(c) == 3 for c in rows_calls)  # no rows kernel got a residual
    assert np.isfinite(got).all()
    assert np.abs(got - off).max() <= 2.0**-6 * np.abs(off).max()
    assert np.abs(got - want).max() <= 2.0**-6 * np.abs(want).max()
    if family == "md2":  # XLA's add on both paths, the same ops in the same order
        np.testing.assert_array_equal(got, off)
    model.fuse_dense_decode(False)


def test_dense_out_row0_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ops.dense_out_row0` asks the kernel for row-0 partials only with the switch on (the default), on
    the kernel path, at one row, with the LayerNorm in the rows kernel on, in
    `dense_out_splits(one_row=True)` K ranges; the bias comes back as bf16."""
    seen: list[tuple] = []

    def fake(x, w, w2=None, *, splits=None, stages=4, row0=False):
        seen.append((x.shape, w.shape, splits, stages, row0))
        return jnp.zeros((splits, w.shape[1]), jnp.float32)

    monkeypatch.setattr(gemv_mgpu, "gemv_partials", fake)
    monkeypatch.setattr(gemv_mgpu, "gemv_supported", lambda x, w: True)
    ops._jitted.cache_clear()
    K, N = 1280, 256
    g, w, b = jnp.ones((1, K), jnp.bfloat16), jnp.ones((K, N), jnp.bfloat16), jnp.ones((N,), jnp.float32)
    with ops.use_backend("kernel"):
        monkeypatch.setenv(NAME, "0")
        assert ops.dense_out_row0(g, w, b) is None  # switched off
        monkeypatch.delenv(NAME)
        out = ops.dense_out_row0(g, w, b)
        assert out is not None and out[0].shape == (4, N) and out[1] is not None and out[1].dtype == jnp.bfloat16
        assert seen == [((1, K), (K, N), 4, ops.dense_decode_gemv()[2], True)]
        assert ops.dense_out_row0(jnp.ones((2, K), jnp.bfloat16), w, b) is None  # one row only
        for name, value in (("KESTREL_JAX_DENSE_LN_IN_ROWS", "0"), ("KESTREL_JAX_GEMV_ROWS", "0"),
                            ("KESTREL_JAX_GEMV_DENSE_OUT_ONE_ROW", "0")):
            monkeypatch.setenv(name, value)
            assert ops.dense_out_row0(g, w, b) is None, name
            monkeypatch.delenv(name)
        monkeypatch.setenv("KESTREL_JAX_GEMV_DENSE_OUT_ONE_ROW", "20")  # more splits than a residual takes
        assert ops.dense_out_row0(g, w, b) is None
        assert len(seen) == 1
    with ops.use_backend("reference"):
        assert ops.dense_out_row0(g, w, b) is None
    monkeypatch.setenv(NAME, "maybe")
    with ops.use_backend("kernel"), pytest.raises(ValueError, match=NAME):
        ops.dense_out_row0(g, w, b)
    jax.clear_caches()


def test_moe_layers_add_the_residual_in_the_next_rows_kernel(stand_ins: list[str],  # noqa: F811
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """KESTREL_JAX_MOE_RESIDUAL_IN_ROWS=1 (the default): an MoE layer followed by an MoE layer (MD3's
    tiny model: layers 2 and 3) asks its down GEMM for the projection's row-0 partials and hands
    them, the projection's bias and its unreduced expert rows to the next layer's QKV + router rows
    kernel with the residual stream; nothing is added in XLA, and the hidden states lie within bf16
    rounding of the reference path and of the switch off. Off, the rows kernel of an MoE layer gets
    no residual."""
    rows_calls: list[tuple] = []
    model, x1, batch1, cache, want = _case(monkeypatch, rows_calls, 13, "md3")
    cfg = model.cfg
    assert [cfg.is_moe_layer(i) for i in range(cfg.n_layers)] == [False, False, True, True]
    qkv = cfg.n_heads * cfg.head_dim + 2 * cfg.n_kv_heads * cfg.head_dim
    counted = _count_xla_adds(monkeypatch)
    name = "KESTREL_JAX_MOE_RESIDUAL_IN_ROWS"
    monkeypatch.delenv(name, raising=False)
    assert ops.moe_residual_in_rows_wanted()
    outs = {}
    for switch in ("0", "1"):  # (each kernel variant is traced once, the first time)
        got = _kernel_forward(model, x1, batch1, cache, monkeypatch, name, switch, rows_calls, stand_ins)
        moe_residual = [c for c in rows_calls if c[1] == qkv and len(c) == 4]
        assert moe_residual == ([(1, qkv, True, ((2, cfg.dim), True))] if switch == "1" else []), switch
        assert counted == []
        assert np.isfinite(got).all()
        assert np.abs(got - want).max() <= 2.0**-6 * np.abs(want).max(), switch
        outs[switch] = got
    assert np.abs(outs["1"] - outs["0"]).max() <= 2.0**-6 * np.abs(outs["0"]).max()
