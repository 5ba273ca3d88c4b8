"""The model's plumbing of KESTREL_JAX_QKV_ATTENTION: a decode step's layers without tau or routing
(MD2's) hand their QKV rows to one launch that writes the new K/V rows and attends
(`ops.decode_qkv_attention`, `qkv_attention_triton`, interpreted here; the kernel itself:
tests/pallas/test_qkv_attention.py). Runner steps of the tiny MD2 (tests/models/
test_fused_dense_decode.py's) give the same tokens, outputs and KV pool within bf16 rounding as
with the switch off; at one row the kernel reads the joined QKV + fc1 product in place."""

from __future__ import annotations

from typing import Any

import jax
import pytest
from test_fused_dense_decode import LAYERS, _assert_same_tokens, _route_through, _steps

from kestrel_jax.pallas import ops
from kestrel_jax.pallas import qkv_attention_triton as qa


@pytest.mark.parametrize("bucket", [1, 2])
def test_decode_steps_through_the_one_launch(bucket: int, monkeypatch: pytest.MonkeyPatch) -> None:
    ref, _ = _steps("md2", "on", bucket)
    assert not ops.qkv_attention_wanted()  # opt-in
    monkeypatch.setenv("KESTREL_JAX_QKV_ATTENTION", "1")
    calls: list[tuple[int, int, int | None]] = []
    kernel = qa.decode_qkv_attention_kernel

    def interpreted(u: jax.Array, *args: Any, **kwargs: Any) -> Any:
        calls.append((u.shape[0], u.shape[1], kwargs.get("u_cols")))
        return kernel(u, *args, interpret=True, **kwargs)

    _route_through(monkeypatch, "decode_qkv_attention", qa, "decode_qkv_attention_kernel", interpreted)
    got, _ = _steps("md2", "on", bucket)
    # each layer once per trace; at one row the joined product (QKV 768 + fc1 512 columns) read in place
    assert calls and len(calls) % LAYERS["md2"] == 0
    assert set(calls) == ({(1, 3 * 256 + 512, 3 * 256)} if bucket == 1 else {(bucket, 3 * 256, None)})
    _assert_same_tokens(got, ref)
