"""The model's plumbing of KESTREL_JAX_DENSE_OUT_GELU_IN: a one-row step's dense layer hands
attention's output and its joined QKV + fc1 product as they are to the decode GEMM kernel, which
forms the joined output + fc2 product's input row itself (`Block.dense_decode_out`,
`ops.dense_out_gelu_in`; the kernel: tests/pallas/test_gemv_gelu_in.py). The other kernels are the
stand-ins of tests/models/test_decode_fusion.py."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from test_decode_fusion import stand_ins  # noqa: F401 (a fixture)
from test_ln_in_rows import _case, _kernel_forward

from kestrel_jax.pallas import gemv_mgpu

_KERNEL = gemv_mgpu.gemv_partials  # the real one (the stand-ins fixture replaces the module's)


def test_dense_layers_form_the_output_products_row_in_the_kernel(stand_ins: list[str],  # noqa: F811
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """With the switch on and joined weights, each dense layer's one-row output + fc2 product runs
    on the kernel (interpreted) from attention's output [1, D] and the whole joined QKV + fc1
    product (its padding rows NaN from the rows kernel's stand-in, fc1 read from the QKV width on):
    the hidden states match the reference path within bf16 rounding. Off (the default), or without
    joined weights, the kernel is not called."""
    calls: list[tuple] = []

    def recorded(o, h, w, b=None, *, splits, h_col=0, stages=4):  # `gemv_gelu_in`, the kernel interpreted
        calls.append((o.shape, h.shape, w.shape, splits, h_col))
        parts = _KERNEL(None, w, splits=splits, stages=stages, gelu_in=(o, h, h_col), interpret=True)
        return gemv_mgpu._finish(gemv_mgpu._summed(parts, 1), b, jnp.dtype(jnp.bfloat16))

    monkeypatch.setattr(gemv_mgpu, "gemv_gelu_in", recorded)
    rows_calls: list[tuple[int, int, bool]] = []
    # MD2's tiny model: all layers dense, no routing (a bf16 rounding apart upstream can pick
    # other experts in an MoE layer, which the comparison below would not forgive)
    model, x1, batch1, cache, want = _case(monkeypatch, rows_calls, 9, "md2")
    cfg = model.cfg
    qkv = cfg.n_heads * cfg.head_dim + 2 * cfg.n_kv_heads * cfg.head_dim
    expect = [((1, cfg.dim), (8, qkv + cfg.ff_dim), (cfg.dim + cfg.ff_dim, cfg.dim),
               gemv_mgpu.gelu_in_splits(cfg.dim, cfg.dim + cfg.ff_dim, 4), qkv)]
    assert expect[0][3] > 0  # the tiny model's widths take the kernel
    forward = functools.partial(_kernel_forward, model, x1, batch1, cache, monkeypatch,
                                "KESTREL_JAX_DENSE_OUT_GELU_IN")
    for fused, switch in ((True, None), (True, "1"), (False, "1")):
        model.fuse_dense_decode(fused)
        got = forward(switch, calls, rows_calls, stand_ins)
        on = fused and switch == "1"
        assert calls == (expect if on else []), (fused, switch)  # traced once: the dense layers share it
        assert np.isfinite(got).all()
        assert np.abs(got - want).max() <= 2.0**-6 * np.abs(want).max(), (fused, switch)
    model.fuse_dense_decode(False)
