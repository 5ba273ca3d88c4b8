"""The model's plumbing of KESTREL_JAX_LN_IN_ROWS: a decode MoE layer's LayerNorm inside its QKV +
router rows kernel (`Attention.qkv_with_ln`, `ops.decode_ln_qkv_router`), and of
KESTREL_JAX_DENSE_LN_IN_ROWS: a dense layer's inside the rows kernel of its joined QKV + fc1 product
(`Block.dense_in_with_ln`, `ops.decode_ln_dense_in`). The GPU kernels are the
stand-ins of tests/models/test_decode_fusion.py (whose rows kernel normalises with
`gemv_mgpu.ln_rows_ref`), here with the rows kernel's calls recorded (the kernel itself:
tests/pallas/test_gemv_ln_in_rows.py)."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_decode_fusion import _bf16_decode_case, _gemv_rows, interpret_epilogue, stand_ins  # noqa: F401 (a fixture)

from kestrel_jax.pallas import gemv_mgpu, ops


def _rows_stand_in(monkeypatch: pytest.MonkeyPatch, calls: list[tuple]) -> None:
    """The rows kernel's stand-in, recording (rows of x, columns of the first product, with `ln`[,
    the residual's partials' shape and whether it has a bias]);
    the QKV epilogue runs interpreted (it reads the padded rows)."""
    def rows(x, w1, b1, w2=None, b2=None, *, ln=None, ln_eps=1e-5, residual=None, **_):
        # (with a residual: its partials' shape and whether it has a bias, a fourth item)
        extra = () if residual is None else ((residual[0].shape, residual[1] is not None),)
        calls.append((x.shape[0], w1.shape[1], ln is not None, *extra))
        return _gemv_rows(x, w1, b1, w2, b2, ln=ln, ln_eps=ln_eps, residual=residual)

    monkeypatch.setattr(gemv_mgpu, "gemv_rows", rows)
    monkeypatch.delenv("KESTREL_JAX_DECODE_QKV_KERNEL")
    interpret_epilogue(monkeypatch)


def _case(monkeypatch: pytest.MonkeyPatch, calls: list[tuple], seed: int,
          family: Literal["md2", "md3"] = "md3") -> tuple:
    """The rows kernel's stand-in in place (`_rows_stand_in`), the tiny bf16 MD3 (or `family`'s)
    decode case and the reference path's hidden states: (model, x, batch, cache, want)."""
    _rows_stand_in(monkeypatch, calls)
    model, x1, batch1, cache = _bf16_decode_case(seed, family)
    with ops.use_backend("reference"):
        want = np.asarray(model(x1, batch1, cache)[0].astype(jnp.float32))
    return model, x1, batch1, cache, want


def _kernel_forward(model, x1, batch1, cache, monkeypatch: pytest.MonkeyPatch, name: str, switch: str | None,
                    *records: list) -> np.ndarray:
    """The hidden states on the kernel path with switch `name` set (None: unset), records cleared."""
    if switch is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, switch)
    for r in records:
        r.clear()
    ops._jitted.cache_clear()
    with ops.use_backend("kernel"):
        return np.asarray(model(x1, batch1, cache)[0].astype(jnp.float32))


def test_layer_norm_in_the_rows_kernel_switch(stand_ins: list[str], monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """With the switch on at one row, every MoE layer hands its residual stream and LayerNorm
    weights to the rows kernel instead of running the LayerNorm kernel (dense layers keep theirs),
    and the rows and normalised rows that come back (padding rows NaN in the products, zero in the
    normalised rows, as the kernel's contract allows) give the reference path's hidden states
    within bf16 rounding (on is the default); at 0 the rows kernel gets the LayerNorm kernel's
    normalised rows padded to 8. (More rows take the LayerNorm kernel either way: `ops.decode_ln_qkv_router`'s
    dispatch test.)"""
    calls: list[tuple[int, int, bool]] = []
    model, x1, batch1, cache, want = _case(monkeypatch, calls, 3)
    cfg = model.cfg
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    dense_ln = ["layernorm"] * (cfg.n_layers - moe_layers)  # dense layers' one-row LayerNorm
    qkv = cfg.n_heads * cfg.head_dim + 2 * cfg.n_kv_heads * cfg.head_dim
    for switch in (None, "0"):
        got = _kernel_forward(model, x1, batch1, cache, monkeypatch, "KESTREL_JAX_LN_IN_ROWS", switch, calls,
                              stand_ins)
        # traced once (the MoE layers share one jitted call): the residual stream's row with the
        # LayerNorm's weights, or the LayerNorm kernel's rows padded to 8
        on = switch != "0"
        assert calls == ([(1, qkv, True)] if on else [(8, qkv, False)]), switch
        assert stand_ins == dense_ln + ([] if on else ["layernorm"] * moe_layers), switch
        assert np.isfinite(got).all()
        assert np.abs(got - want).max() <= 2.0**-6 * np.abs(want).max(), switch
    monkeypatch.setenv("KESTREL_JAX_LN_IN_ROWS", "yes")
    ops._jitted.cache_clear()
    with ops.use_backend("kernel"), pytest.raises(ValueError, match="KESTREL_JAX_LN_IN_ROWS"):
        jax.eval_shape(lambda: model(x1, batch1, cache))


def test_dense_layer_norm_in_the_rows_kernel_switch(stand_ins: list[str], monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """KESTREL_JAX_DENSE_LN_IN_ROWS (on by default) at one row: each dense layer with joined weights hands its
    residual stream, LayerNorm weights and joined QKV + fc1 weight to the rows kernel instead of
    running the one-row LayerNorm kernel and XLA's product; the QKV epilogue (interpreted) reads
    row 0's QKV columns of the padded product in place (its padding rows NaN here) and the hidden
    states match the reference path within bf16 rounding. At 0 the rows kernel never sees the
    joined weight; without joined weights the switch changes nothing."""
    calls: list[tuple[int, int, bool]] = []
    model, x1, batch1, cache, want = _case(monkeypatch, calls, 5)
    cfg = model.cfg
    dense = cfg.n_layers - sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    joined = cfg.n_heads * cfg.head_dim + 2 * cfg.n_kv_heads * cfg.head_dim + cfg.ff_dim
    assert dense >= 1
    monkeypatch.setenv("KESTREL_JAX_LN_IN_ROWS", "0")  # the MoE layers keep their LayerNorm launches
    for fused, switch in ((True, None), (True, "0"), (False, None)):
        model.fuse_dense_decode(fused)
        got = _kernel_forward(model, x1, batch1, cache, monkeypatch, "KESTREL_JAX_DENSE_LN_IN_ROWS", switch, calls,
                              stand_ins)
        on = fused and switch != "0"
        assert ((1, joined, True) in calls) == on, (fused, switch)
        assert all(c[1] != joined for c in calls if not on), (fused, switch)
        assert stand_ins.count("layernorm") == sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers)) + (
            0 if on else dense), (fused, switch)
        assert np.isfinite(got).all()
        assert np.abs(got - want).max() <= 2.0**-6 * np.abs(want).max(), (fused, switch)
    model.fuse_dense_decode(False)
