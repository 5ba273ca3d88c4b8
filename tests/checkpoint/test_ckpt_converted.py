"""Orbax save/restore of converted params, and telling the two checkpoint formats apart."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kestrel_jax.checkpoint import (
    CheckpointError,
    is_converted_checkpoint,
    restore_converted,
    save_converted,
    write_synthetic_checkpoint,
)
from kestrel_jax.models.config import config_to_dict, tiny_config


def _tree(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((4, 6, 8), dtype=np.float32)
    return {
        "text": {
            "wte": (w[0] * 0.02).astype(ml_dtypes.bfloat16),
            "blocks": {"0": {"moe_up": (w * 100).astype(ml_dtypes.float8_e4m3fn),
                             "moe_up_scale": rng.random((4, 6), dtype=np.float32)}},
        },
        "vision": {"pos_emb": jnp.asarray(w[1], dtype=jnp.bfloat16),
                   "fp8_dev": jnp.asarray(w[2] * 50, dtype=jnp.float8_e4m3fn)},
        "scalar": np.float32(0.05).reshape(()),
    }


def _bits(x) -> bytes:
    return np.asarray(x).tobytes()


def test_round_trip_bitwise(tmp_path):
    tree = _tree(0)
    config = {"family": "md3", "config": config_to_dict(tiny_config("md3"))}
    dst = save_converted(tmp_path / "conv", config, tree)
    assert is_converted_checkpoint(dst)
    got_config, got = restore_converted(dst)
    assert got_config == config
    flat, treedef = jax.tree_util.tree_flatten(tree)
    got_flat, got_treedef = jax.tree_util.tree_flatten(got)
    assert str(treedef) == str(got_treedef)
    for a, b in zip(flat, got_flat, strict=True):
        assert np.asarray(a).dtype == np.asarray(b).dtype and np.shape(a) == np.shape(b)
        assert _bits(a) == _bits(b)
    # With a target: structure and dtypes from abstract arrays.
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), tree)
    _, got2 = restore_converted(dst, target)
    assert all(_bits(a) == _bits(b) for a, b in zip(flat, jax.tree_util.tree_leaves(got2), strict=True))


def test_overwrite_and_format_detection(tmp_path):
    dst = save_converted(tmp_path / "conv", {"a": 1}, _tree(1))
    with pytest.raises(CheckpointError, match="overwrite"):
        save_converted(dst, {"a": 2}, _tree(2))
    save_converted(dst, {"a": 2}, _tree(2), overwrite=True)
    cfg, got = restore_converted(dst)
    assert cfg == {"a": 2} and _bits(got["text"]["wte"]) == _bits(_tree(2)["text"]["wte"])

    hf = write_synthetic_checkpoint(tmp_path / "hf", tiny_config("md2"), seed=0, tokenizer=False)
    assert not is_converted_checkpoint(hf)
    assert not is_converted_checkpoint(tmp_path / "nothing")
    with pytest.raises(CheckpointError, match="not a converted checkpoint"):
        restore_converted(hf)
    with pytest.raises(CheckpointError, match="refusing"):
        save_converted(hf, {}, _tree(0), overwrite=True)
    with pytest.raises(CheckpointError, match="JSON"):
        save_converted(tmp_path / "bad", {"x": object()}, _tree(0))
