"""Every malformed checkpoint is refused with a CheckpointError naming the tensor and the file."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
from ckpt_helpers import edit_config, edited_copy, write_tensors

from kestrel_jax.checkpoint import HFCheckpoint, write_synthetic_checkpoint
from kestrel_jax.checkpoint import reader as reader_mod
from kestrel_jax.checkpoint.spec import CheckpointError
from kestrel_jax.models.config import tiny_config


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("base_md3")
    return write_synthetic_checkpoint(d, tiny_config("md3"), seed=11, fp8_experts=True, kv_scales=True,
                                      tokenizer=False)


@pytest.fixture(scope="module")
def base_md2(tmp_path_factory):
    d = tmp_path_factory.mktemp("base_md2")
    return write_synthetic_checkpoint(d, tiny_config("md2"), seed=12, tokenizer=False)


@pytest.fixture
def no_data_reads(monkeypatch):
    """Fail the test if any tensor data is read (validation must come first)."""
    def forbidden(*args, **kwargs):
        raise AssertionError("tensor data read before validation finished")
    monkeypatch.setattr(reader_mod, "read_range", forbidden)


def _open_error(path, **kw) -> str:
    with pytest.raises(CheckpointError) as info:
        HFCheckpoint.open(path, progress=False, **kw)
    return str(info.value)


def test_missing_tensor(base, tmp_path, no_data_reads):
    bad = edited_copy(base, tmp_path / "c", lambda t: t.pop("model.text.blocks.1.attn.qkv.bias"))
    msg = _open_error(bad)
    assert "missing tensor text.blocks.1.attn.qkv.bias" in msg
    assert "'model.text.blocks.1.attn.qkv.bias'" in msg and str(bad) in msg


def test_wrong_shape(base, tmp_path, no_data_reads):
    def edit(t):
        t["model.vision.blocks.5.attn.proj.weight"] = t["model.vision.blocks.5.attn.proj.weight"][:, :-1].copy()
    bad = edited_copy(base, tmp_path / "c", edit)
    msg = _open_error(bad)
    assert "vision.blocks.5.attn.proj.weight" in msg and "'model.vision.blocks.5.attn.proj.weight'" in msg
    assert "[64, 63]" in msg and "expected [64, 64]" in msg and str(bad / "model.safetensors") in msg


@pytest.mark.parametrize(("stored", "new_dtype"), [
    ("model.text.blocks.0.attn.proj.bias", np.int32),
    ("model.text.blocks.3.mlp.fc2.weight", np.float16),  # an FP8 expert stack stored as f16
    ("model.text.blocks.0.ln.weight", np.float64),
])
def test_wrong_dtype(base, tmp_path, no_data_reads, stored, new_dtype):
    def edit(t):
        t[stored] = t[stored].astype(np.float32).astype(new_dtype)
    bad = edited_copy(base, tmp_path / "c", edit)
    msg = _open_error(bad)
    assert stored[len("model."):] in msg and f"'{stored}'" in msg and "dtype" in msg
    assert str(bad / "model.safetensors") in msg


def test_unexpected_and_duplicate_tensors(base_md2, tmp_path, no_data_reads):
    def extra(t):
        t["model.text.blocks.0.attn.rotary"] = np.zeros(4, np.float32)
    msg = _open_error(edited_copy(base_md2, tmp_path / "a", extra))
    assert "unexpected tensor text.blocks.0.attn.rotary" in msg and "'model.text.blocks.0.attn.rotary'" in msg

    def dup(t):  # the same tensor under its HF and its internal name
        t["text_model.transformer.embd.wte.weight"] = t["model.text.wte"]
    msg = _open_error(edited_copy(base_md2, tmp_path / "b", dup))
    assert "text.wte" in msg and "'model.text.wte'" in msg and "'text_model.transformer.embd.wte.weight'" in msg

    def md3_only(t):  # a region LayerNorm in an MD2 checkpoint is not silently used
        t["model.region.ln.weight"] = np.ones(256, np.float32)
        t["model.region.ln.bias"] = np.zeros(256, np.float32)
    msg = _open_error(edited_copy(base_md2, tmp_path / "c", md3_only))
    assert "unexpected tensor region.ln.weight" in msg


def test_ignorable_buffers_and_orig_mod(base_md2, tmp_path):
    def edit(t):
        t["model.text.blocks.0.kv_cache.k_cache"] = np.zeros((1, 4, 8, 64), np.float32)
        t["model.text.freqs_cis"] = np.zeros((8, 16, 2), np.float32)
        for name in [n for n in t if n.startswith("model.vision.")]:
            t["model._orig_mod." + name[len("model."):]] = t.pop(name)
    ckpt = HFCheckpoint.open(edited_copy(base_md2, tmp_path / "c", edit), progress=False)
    assert set(ckpt.ignored) == {"model.text.blocks.0.kv_cache.k_cache", "model.text.freqs_cis"}
    ref = HFCheckpoint.open(base_md2, progress=False)
    assert ckpt.config == ref.config
    assert ckpt.read("vision.pos_emb").tobytes() == ref.read("vision.pos_emb").tobytes()


def test_truncated_file(base, tmp_path, no_data_reads):
    bad = edited_copy(base, tmp_path / "c", lambda t: None)
    f = bad / "model.safetensors"
    os.truncate(f, f.stat().st_size - 3)
    msg = _open_error(bad)
    assert "truncated" in msg and str(f) in msg and "'model.region.size_decoder.bias'" in msg  # last tensor


def test_truncated_or_changed_after_validation(base, tmp_path):
    bad = edited_copy(base, tmp_path / "c", lambda t: None)
    f = bad / "model.safetensors"
    ckpt = HFCheckpoint.open(bad, progress=False)
    first = ckpt.read("text.wte")
    os.truncate(f, f.stat().st_size - 1000)
    with pytest.raises(CheckpointError, match="truncated") as info:
        list(ckpt.iter_tensors(progress=False))
    assert str(f) in str(info.value)
    # Rewritten with a different header (another seed, one tensor fewer).
    f.unlink()
    write_tensors(f, {"model.text.wte": first})
    with pytest.raises(CheckpointError, match="changed since it was validated") as info:
        ckpt.read("text.wte")
    assert "'model.text.wte'" in str(info.value)


@pytest.mark.parametrize("payload", [
    b"",  # empty file
    struct.pack("<Q", 40) + b"{not json at all, just garbage bytes....}",
    struct.pack("<Q", 1 << 60) + b"{}",  # absurd header length
    struct.pack("<Q", 9) + b'["a", 1]\n',  # JSON but not an object
    struct.pack("<Q", 2) + b"{}",  # valid but empty -> missing tensors
])
def test_header_garbage(tmp_path, payload):
    f = tmp_path / "model.safetensors"
    f.write_bytes(payload)
    msg = _open_error(tmp_path)
    assert str(f) in msg


def test_header_entry_errors(tmp_path):
    def write(header: dict, data: bytes = b"") -> None:
        raw = json.dumps(header).encode()
        (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data)

    write({"model.text.wte": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 6]}}, b"\0" * 8)
    assert "'model.text.wte'" in _open_error(tmp_path) and "needs 8" in _open_error(tmp_path)
    write({"model.text.wte": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}}, b"\0" * 2)
    assert "unsupported dtype" in _open_error(tmp_path)
    write({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
           "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, b"\0" * 6)
    assert "overlap" in _open_error(tmp_path)


def test_config_contradicting_shapes(base, tmp_path, no_data_reads):
    bad = edited_copy(base, tmp_path / "a", lambda t: None)
    edit_config(bad, lambda c: c["config"]["text"].update(dim=512))
    msg = _open_error(bad)
    assert "config.json" in msg and str(bad / "config.json") in msg and "text.dim = 512" in msg
    assert "text.wte" in msg and str(bad / "model.safetensors") in msg and "implies 256" in msg

    bad = edited_copy(base, tmp_path / "b", lambda t: None)
    edit_config(bad, lambda c: c["config"]["text"]["moe"].update(start_layer=3))
    msg = _open_error(bad)
    assert "text.moe.start_layer = 3" in msg and "text.blocks.2.mlp" in msg and "implies 2" in msg

    bad = edited_copy(base, tmp_path / "c", lambda t: None)
    edit_config(bad, lambda c: c.update(moondream_family="moondream2") or c["config"]["text"].pop("moe"))
    assert "describes a md2 model" in _open_error(bad)

    bad = edited_copy(base, tmp_path / "d", lambda t: None)
    (bad / "config.json").write_text("{oops")
    assert "config.json" in _open_error(bad)


def test_sharded_index_errors(tmp_path, no_data_reads):
    good = write_synthetic_checkpoint(tmp_path / "good", tiny_config("md2"), seed=1, shards=3, tokenizer=False)
    index = json.loads((good / "model.safetensors.index.json").read_text())
    shard2 = "model-00002-of-00003.safetensors"

    missing = edited_copy(good, tmp_path / "missing", lambda t: None, filename=shard2)
    (missing / shard2).unlink()
    msg = _open_error(missing)
    assert shard2 in msg and "does not exist" in msg
    holder = next(n for n, f in index["weight_map"].items() if f == shard2)
    assert repr(holder) in msg

    wrong = edited_copy(good, tmp_path / "wrong", lambda t: None, filename=shard2)
    index2 = json.loads(json.dumps(index))
    index2["weight_map"][holder] = "model-00001-of-00003.safetensors"
    (wrong / "model.safetensors.index.json").write_text(json.dumps(index2))
    msg = _open_error(wrong)
    assert repr(holder) in msg and "index" in msg

    (wrong / "model.safetensors.index.json").write_text("[]")
    assert "not a valid safetensors index" in _open_error(wrong)


def test_paths(tmp_path):
    assert "no such file" in _open_error(tmp_path / "nope")
    (tmp_path / "other.bin").write_bytes(b"x")
    assert "model.safetensors" in _open_error(tmp_path)
