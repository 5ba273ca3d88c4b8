"""The model's prefill and mixed steps through the prefill QKV epilogue kernel
(`ops.prefill_qkv`: rotary, tau and the KV write in one launch, q split into a mixed step's decode and
prefill rows), interpreted on the CPU inside the runner's jitted steps, against the same steps on the
jnp path. MD2 (no tau): outputs and KV pool bit-identical. MD3: tau's GELU differs between the paths
(the kernel path forms the factors with the polynomial erf, `ops.tau_gelu`), so the sampled tokens
must agree and values within bf16 rounding. The same steps through the residual + LayerNorm kernel
(`ops.residual_layer_norm`) likewise."""

from __future__ import annotations

from typing import Any, Literal

import jax.numpy as jnp
import numpy as np
import pytest

from kestrel_jax.models.config import tiny_config
from kestrel_jax.models.moondream import random_model
from kestrel_jax.pallas import layer_norm_blocks as lnb
from kestrel_jax.pallas import ops
from kestrel_jax.pallas import qkv_epilogue as qe
from kestrel_jax.serving import batch as bt
from kestrel_jax.serving.runner import Runner, RunnerConfig

PAGE = 16
Model = Literal["md2", "md3"]


def _force(monkeypatch: pytest.MonkeyPatch, op: str, patch: tuple[Any, str, Any], calls: list[int]) -> None:
    """`ops.<op>` through its kernel (`patch`: the attribute to set while it runs, making the kernel
    interpreted), the other ops staying on jnp; `calls` counts its traces."""
    original = getattr(ops, op)

    def forced(*args: Any, **kwargs: Any) -> Any:
        with ops.use_backend("kernel"), monkeypatch.context() as m:
            m.setattr(*patch)
            out = original(*args, **kwargs)
        assert out is not None
        calls[0] += 1
        return out

    monkeypatch.setattr(ops, op, forced)


def _run(model_name: Model) -> list[np.ndarray]:
    """A prefill of two prompts, then a mixed step (two decode rows + a third prompt); returns the
    sampled outputs and the KV pool."""
    model = random_model(tiny_config(model_name, vision_layers=2), dtype=jnp.bfloat16, seed=3)
    r = Runner(model, RunnerConfig(num_pages=16, kv_dtype="bf16", max_seq_len=128, page_size=PAGE,
                                   vision_buckets=(2,)), out_rows=8)
    p = r.max_pages_per_seq
    a, b, c = [1, 700, 33, 4000, 12, 9, 81, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [1, 55, 66, 77, 88], [1, 300, 301]
    images = jnp.zeros((1, 728, model.cfg.text.dim), model.dtype)
    pre = bt.text_prefill([(2, a), (6, b)], tokens=32, max_seqs=2, pages=p, page_size=PAGE)
    first = np.asarray(r.prefill(*pre, images))
    dec = bt.text_decode([(2, len(a), int(first[0, 0]), -1), (6, len(b), int(first[1, 0]), -1)], bucket=2, pages=p,
                         page_size=PAGE)
    pre2 = bt.text_prefill([(10, c)], tokens=32, max_seqs=2, pages=p, page_size=PAGE)
    mixed = np.asarray(r.mixed(*dec, None, *pre2, images))
    kv = [np.asarray(x.astype(jnp.float32)) for x in (*r.cache.k, *r.cache.v)]
    return [first, mixed, *kv]


@pytest.mark.parametrize("model_name", ["md2"])  # MD3 (tau): the kernel tests' factor mode and dispatch (CI time)
def test_steps_through_the_prefill_kernel_equal_the_jnp_path(model_name: Model, monkeypatch: pytest.MonkeyPatch):
    kernel_runs = [0]
    kernel = qe.prefill_qkv_kernel

    def interpreted(*args: Any, **kwargs: Any) -> Any:
        kernel_runs[0] += 1
        return kernel(*args, interpret=True, **kwargs)

    monkeypatch.setattr(qe, "prefill_qkv_kernel", interpreted)  # counts any use on the jnp path too
    ref = _run(model_name)
    n_ref = kernel_runs[0]
    calls = [0]
    _force(monkeypatch, "prefill_qkv", (qe, "prefill_qkv_kernel", interpreted), calls)
    got = _run(model_name)
    n_got = kernel_runs[0] - n_ref
    assert calls[0] == n_got
    layers = tiny_config(model_name).text.n_layers
    assert n_ref == 0 and n_got == 2 * layers  # every layer of both steps (traced once each)
    if model_name == "md2":
        for x, y in zip(got, ref, strict=True):
            np.testing.assert_array_equal(x, y)
    else:
        for x, y in zip(got[:2], ref[:2], strict=True):
            np.testing.assert_array_equal(x[:, 0], y[:, 0])  # sampled tokens
        for x, y in zip(got[2:], ref[2:], strict=True):  # KV: V carries tau (bf16 rounding apart)
            np.testing.assert_allclose(x, y, rtol=2.0**-6, atol=2.0**-6 * np.abs(y).max())
    assert any(np.abs(k).sum() > 0 for k in ref[2:])


def test_steps_through_the_layer_norm_kernel(monkeypatch: pytest.MonkeyPatch):
    """The residual + LayerNorm kernel (`ops.residual_layer_norm`) interpreted inside the same
    steps: its statistics are reduced in another order than XLA's, so the sampled tokens must
    agree and the KV pool within bf16 rounding."""
    ref = _run("md2")
    calls, kernel_runs = [0], [0]

    def interpreted(*args: Any, **kwargs: Any) -> Any:
        kernel_runs[0] += 1
        return lnb.residual_layer_norm_blocks_kernel(*args, interpret=True, **kwargs)

    _force(monkeypatch, "residual_layer_norm", (ops, "_jitted", lambda fn, static=(): interpreted), calls)
    got = _run("md2")
    # per step: the first block's, then all but the last; each through the kernel
    assert calls[0] == kernel_runs[0] == 2 * tiny_config("md2").text.n_layers
    for x, y in zip(got[:2], ref[:2], strict=True):
        np.testing.assert_array_equal(x[:, 0], y[:, 0])  # sampled tokens
    for x, y in zip(got[2:], ref[2:], strict=True):
        np.testing.assert_allclose(x, y, rtol=2.0**-6, atol=2.0**-6 * np.abs(y).max())
