"""Decode MoE layers can run attention and the output projection on a second XLA stream
(`KESTREL_JAX_SIDE_STREAM`): the decode forward of a small MD3, lowered for an H100 with the
kernel backend, carries the stream annotation around the attention kernel exactly when the switch
is on; the reference backend ignores it (and computes the same values either way)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from kestrel_jax.models.config import tiny_config
from kestrel_jax.models.moondream import random_model
from kestrel_jax.models.text import AttentionBatch, KVCache
from kestrel_jax.pallas import ops
from kestrel_jax.pallas.paged_attention import init_kv_pool

PAGES, PAGE, MAXP = 8, 64, 4


def _decode_fn(text):
    graphdef, state = nnx.split(text)

    def fwd(state, x, cache, positions, slots, kv_lens, table):
        model = nnx.merge(graphdef, state)
        batch = AttentionBatch(positions, slots, kv_lens, table)
        h, new_cache, _ = model(x, batch, cache)
        return h, new_cache

    return fwd, state


def _inputs(text, rng: np.random.Generator, t: int = 1):
    cfg = text.cfg
    pool = init_kv_pool(cfg.n_layers, PAGES, PAGE, cfg.n_kv_heads, cfg.head_dim, jnp.float8_e4m3fn)
    cache = KVCache(tuple(k for k, _ in pool), tuple(v for _, v in pool), jnp.ones(cfg.n_layers) * 0.05,
                    jnp.ones(cfg.n_layers) * 0.05)
    x = jnp.asarray(rng.standard_normal((t, cfg.dim)), jnp.bfloat16)
    positions = jnp.asarray(rng.integers(0, 100, t), jnp.int32)
    table = jnp.asarray(rng.permutation(PAGES)[: t * MAXP].reshape(t, MAXP), jnp.int32)
    slots = table[:, 0] * PAGE + positions % PAGE
    return x, cache, positions, slots, positions + 1, table


def _lowered_text(text_model, args) -> str:
    """A fresh function per call: JAX's trace cache does not see the environment switch."""
    fwd, state = _decode_fn(text_model)
    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Auto,), abstract_device=device)
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (state, *args))
    with jax.sharding.use_abstract_mesh(mesh), ops.use_backend("kernel"):
        return jax.jit(fwd).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


@pytest.fixture(scope="module")
def md3():
    return random_model(tiny_config("md3")).text


def test_side_stream_wraps_decode_attention_in_moe_layers_only(md3, monkeypatch: pytest.MonkeyPatch):
    args = _inputs(md3, np.random.default_rng(0))
    monkeypatch.delenv("KESTREL_JAX_SIDE_STREAM", raising=False)
    plain = _lowered_text(md3, args)
    assert "_xla_stream_annotation" not in plain
    monkeypatch.setenv("KESTREL_JAX_SIDE_STREAM", "1")
    text = _lowered_text(md3, args)
    calls = re.findall(r'call @(compute_on[\w.]*)\(.*_xla_stream_annotation = "1"', text)
    moe_layers = sum(md3.cfg.is_moe_layer(i) for i in range(md3.cfg.n_layers))
    assert len(calls) == moe_layers >= 1
    # the annotated functions hold the decode attention kernel and the projection's decode GEMM,
    # flat: a nested call would inherit the annotation, which XLA's stream assignment rejects
    bodies = re.findall(r"func\.func private @compute_on[\w.]*\(.*?\n  \}", text, flags=re.S)
    assert bodies and all(b.count("custom_call @mosaic_gpu_v2") == 2 for b in bodies)
    assert not any(re.search(r"(?<!custom_)call @", b) for b in bodies)
    monkeypatch.setenv("KESTREL_JAX_SIDE_STREAM", "x")
    with pytest.raises(ValueError, match="stream number"):
        _lowered_text(md3, args)


def test_reference_backend_ignores_the_switch(md3, monkeypatch: pytest.MonkeyPatch):
    args = _inputs(md3, np.random.default_rng(1))
    monkeypatch.setenv("KESTREL_JAX_SIDE_STREAM", "1")
    with ops.use_backend("reference"):
        assert ops.side_stream() is None
        fwd, state = _decode_fn(md3)
        h_on, _ = jax.jit(fwd)(state, *args)
    monkeypatch.delenv("KESTREL_JAX_SIDE_STREAM")
    with ops.use_backend("reference"):
        fwd, state = _decode_fn(md3)
        h_off, _ = jax.jit(fwd)(state, *args)
    np.testing.assert_array_equal(np.asarray(h_on, np.float32), np.asarray(h_off, np.float32))
