"""The split of a dense layer's QKV and fc1 products in prefill steps
(`ops.split_dense_prefill_gemms`, on by default on the kernel path): an optimization barrier on the
MLP's input, so XLA cannot merge the two GEMMs over weights concatenated at run time. The barrier
changes no value: prefill outputs and the KV pool are bit-identical with it, and it appears in
prefill steps only."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kestrel_jax.models.config import tiny_config
from kestrel_jax.models.moondream import random_model
from kestrel_jax.pallas import ops
from kestrel_jax.serving import batch as bt
from kestrel_jax.serving.runner import Runner, RunnerConfig


def _prefill_and_decode(split: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[np.ndarray], str, str]:
    monkeypatch.setattr(ops, "split_dense_prefill_gemms", lambda: split)
    # (two vision layers instead of 27: no step here runs the encoder; its weights only cost start-up)
    model = random_model(tiny_config("md2", vision_layers=2), dtype=jnp.float32, seed=5)
    r = Runner(model, RunnerConfig(num_pages=16, kv_dtype="f32", max_seq_len=256, page_size=64, vision_buckets=(2,)))
    p = r.max_pages_per_seq
    pre = bt.text_prefill([(2, list(range(3, 40))), (5, list(range(100, 121)))], tokens=64, max_seqs=2, pages=p,
                          page_size=64)
    images = jnp.zeros((1, model.cfg.text.prefix_attn - 1, model.cfg.text.dim), model.dtype)
    prefill_text = r._prefill.jitted.lower(r.lm_params, r.cache, *pre, images).as_text()
    out = r.prefill(*pre, images)
    dec = bt.text_decode([(2, 37, 7, -1), (5, 21, 9, -1)], bucket=2, pages=p, page_size=64)
    decode_text = r._decode_fn(1).jitted.lower(r.lm_params, r.cache, *dec, r._feed(None)).as_text()
    toks, _ = r.decode(*dec, None, 1)
    return [np.asarray(out), np.asarray(toks), *[np.asarray(k) for k in r.cache.k]], prefill_text, decode_text


def test_the_barrier_changes_nothing_but_the_program(monkeypatch: pytest.MonkeyPatch) -> None:
    plain, plain_prefill, _ = _prefill_and_decode(False, monkeypatch)
    split, split_prefill, split_decode = _prefill_and_decode(True, monkeypatch)
    n_dense = sum(not tiny_config("md2").text.is_moe_layer(i) for i in range(tiny_config("md2").text.n_layers))
    assert n_dense > 0
    assert "optimization_barrier" not in plain_prefill
    assert split_prefill.count("optimization_barrier") == n_dense  # one per dense layer, prefill only
    assert "optimization_barrier" not in split_decode
    for a, b in zip(plain, split, strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_split_is_on_by_default_on_the_kernel_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KESTREL_JAX_SPLIT_DENSE_GEMMS", raising=False)
    with ops.use_backend("reference"):
        assert not ops.split_dense_prefill_gemms()
    with ops.use_backend("kernel"):
        assert ops.split_dense_prefill_gemms()
        monkeypatch.setenv("KESTREL_JAX_SPLIT_DENSE_GEMMS", "0")
        assert not ops.split_dense_prefill_gemms()
