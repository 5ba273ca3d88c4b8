"""Synthetic writer -> reader round trips: layouts, shards, FP8 experts, KV scales, region LN."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from ckpt_helpers import raw_tensors

from kestrel_jax.checkpoint import HFCheckpoint, write_synthetic_checkpoint
from kestrel_jax.checkpoint.spec import CheckpointError
from kestrel_jax.models.config import tiny_config

try:
    from kestrel_jax.tokenizer import build_synthetic_tokenizer  # noqa: F401

    HAS_TOKENIZER = True
except ImportError:  # written by another helper; the checkpoint does not depend on it
    HAS_TOKENIZER = False

CASES = [  # (family, layout, shards, fp8_experts, kv_scales, region_ln)
    ("md2", "hf", 1, False, False, False),
    ("md2", "internal", 3, False, True, False),
    ("md3", "hf", 1, False, False, False),
    ("md3", "hf", 4, True, True, True),
    ("md3", "internal", 1, True, False, True),
    ("md3", "internal", 2, False, True, False),
]


def _expected_config(family, region_ln):
    cfg = tiny_config(family)
    return dataclasses.replace(cfg, region=dataclasses.replace(cfg.region, has_ln=region_ln))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Per family, canonical tensors of an HF single-file checkpoint with every option on."""
    out = {}
    for family in ("md2", "md3"):
        d = tmp_path_factory.mktemp(f"ref_{family}")
        write_synthetic_checkpoint(d, tiny_config(family), seed=7, fp8_experts=family == "md3",
                                   kv_scales=True, region_ln=family == "md3", tokenizer=False)
        out[family] = dict(HFCheckpoint.open(d, progress=False).iter_tensors(progress=False))
    return out


@pytest.mark.parametrize(("family", "layout", "shards", "fp8", "kv", "region_ln"), CASES)
def test_round_trip(tmp_path, reference, family, layout, shards, fp8, kv, region_ln):
    cfg = tiny_config(family)
    write_synthetic_checkpoint(tmp_path, cfg, seed=7, layout=layout, shards=shards, fp8_experts=fp8,
                               kv_scales=kv, region_ln=region_ln, tokenizer=HAS_TOKENIZER)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) == shards
    assert (tmp_path / "model.safetensors.index.json").is_file() == (shards > 1)
    stored = {n: a.shape for f in files for n, a in raw_tensors(tmp_path / f).items()}
    if layout == "internal":
        assert stored["text_model.transformer.embd.wte.weight"] == (8192, 256)
        assert not any(n.startswith("model.") for n in stored)
        assert stored["region_model.size_features.weight"] == (256, 2)  # legacy: transposed
        assert stored["region_model.coordinate_features.weight"] == (128, 1)
        if family == "md3":
            assert stored["text_model.transformer.h.0.tau_wqwv"] == (8, 768)
            assert stored["text_model.transformer.h.2.mlp.experts.weight"] == (16, 128, 256)
    else:
        assert all(n.startswith("model.") for n in stored)

    ckpt = HFCheckpoint.open(tmp_path, progress=False)
    assert ckpt.config == _expected_config(family, region_ln)
    assert (ckpt.fp8_experts, ckpt.kv_scales, ckpt.region_ln, ckpt.layout) == (fp8, kv, region_ln, layout)
    assert ckpt.assumed == ()
    got = dict(ckpt.iter_tensors(progress=False))
    assert list(got) != [] and set(got) == set(ckpt.specs)
    ref = reference[family]
    for name, arr in got.items():
        spec = ckpt.specs[name]
        assert arr.shape == spec.shape, name
        # Values depend on (seed, canonical name) only, so every layout matches the reference
        # bitwise, except expert weights whose storage (bf16 vs fp8) differs between cases.
        if name in ref and ref[name].dtype == arr.dtype:
            assert arr.tobytes() == ref[name].tobytes(), name
    if HAS_TOKENIZER:
        tok = json.loads((tmp_path / "tokenizer.json").read_text())
        assert tok["model"]["type"] == "BPE"


def test_values(reference):
    t = reference["md3"]
    cfg = tiny_config("md3")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    assert t["text.wte"].dtype == bf16
    assert np.all(t["text.blocks.0.ln.weight"].astype(np.float32) == 1)
    assert np.all(t["text.blocks.0.ln.bias"].astype(np.float32) == 0)
    assert np.all(t["text.blocks.0.attn.qkv.bias"].astype(np.float32) == 0)
    lm_bias = t["text.lm_head.bias"].astype(np.float32)
    assert np.all(lm_bias[:16] < -9000) and np.all(lm_bias[16:] == 0)
    w = t["text.wte"].astype(np.float32)
    assert abs(w.std() - 0.02) < 0.001 and abs(w.mean()) < 0.001
    alpha = np.concatenate([t[f"text.blocks.{i}.attn.tau.alpha"].astype(np.float32) for i in range(4)])
    assert 0.3 < alpha.std() < 3  # N(0, 1), 16 samples
    assert abs(t["region.size_features"].astype(np.float32).std() - 1) < 0.15
    for i in range(cfg.text.n_layers):
        assert t[f"text.blocks.{i}.attn.k_scale"].dtype == np.float32
        assert float(t[f"text.blocks.{i}.attn.v_scale"]) == pytest.approx(0.05)
    # FP8 experts: per-output-row scales; the largest |value| of each row hits the e4m3 max.
    q = t["text.blocks.2.mlp.fc1.weight"]
    s = t["text.blocks.2.mlp.fc1.scale"]
    assert q.dtype == np.dtype(ml_dtypes.float8_e4m3fn) and s.dtype == np.float32
    assert q.shape == (16, 128, 256) and s.shape == (16, 128)
    assert np.all(np.abs(q.astype(np.float32)).max(axis=-1) == 448.0)
    deq = q.astype(np.float32) * s[..., None]
    assert abs(deq.std() - 0.02) < 0.001
    assert t["text.blocks.3.mlp.fc2.scale"].shape == (16, 256)


def test_deterministic(tmp_path):
    cfg = tiny_config("md3")
    kw: dict[str, Any] = dict(fp8_experts=True, kv_scales=True, shards=2, tokenizer=HAS_TOKENIZER)
    a = write_synthetic_checkpoint(tmp_path / "a", cfg, seed=3, **kw)
    b = write_synthetic_checkpoint(tmp_path / "b", cfg, seed=3, **kw)
    c = write_synthetic_checkpoint(tmp_path / "c", cfg, seed=4, **kw)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n
    shard = "model-00001-of-00002.safetensors"
    assert (a / shard).read_bytes() != (c / shard).read_bytes()


def test_library_reads_written_file(tmp_path):
    """The official safetensors library reads our streamed files and agrees bitwise."""
    safe_open = pytest.importorskip("safetensors").safe_open
    write_synthetic_checkpoint(tmp_path, tiny_config("md2"), seed=5, dtype="float16", tokenizer=False)
    ckpt = HFCheckpoint.open(tmp_path, progress=False)
    with safe_open(str(tmp_path / "model.safetensors"), framework="flax") as f:
        assert set(f.keys()) == {f"model.{n}" for n in ckpt.names}
        assert f.metadata() == {"format": "pt"}
        for name in ("text.wte", "vision.pos_emb", "region.coord_features", "text.lm_head.bias"):
            ref = np.asarray(f.get_tensor(f"model.{name}"))
            got = ckpt.read(name)
            assert got.dtype == np.float16 and np.array_equal(got, ref), name


def test_writer_refuses_to_clobber_and_bad_args(tmp_path):
    cfg = tiny_config("md2")
    write_synthetic_checkpoint(tmp_path, cfg, seed=0, tokenizer=False)
    with pytest.raises(CheckpointError, match="overwrite"):
        write_synthetic_checkpoint(tmp_path, cfg, seed=0, tokenizer=False)
    # Re-writing single-file over sharded must not leave a stale index behind.
    write_synthetic_checkpoint(tmp_path, cfg, seed=0, shards=2, tokenizer=False, overwrite=True)
    write_synthetic_checkpoint(tmp_path, cfg, seed=0, tokenizer=False, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    with pytest.raises(CheckpointError, match="shards"):
        write_synthetic_checkpoint(tmp_path / "x", cfg, seed=0, shards=100_000, tokenizer=False)
    with pytest.raises(CheckpointError, match="layout"):
        write_synthetic_checkpoint(tmp_path / "y", cfg, seed=0, layout="torch", tokenizer=False)  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match="MoE"):
        write_synthetic_checkpoint(tmp_path / "z", cfg, seed=0, fp8_experts=True, tokenizer=False)


def test_cli(tmp_path, capsys):
    import importlib.util

    from ckpt_helpers import REPO

    spec = importlib.util.spec_from_file_location("make_synth", REPO / "tools" / "make_synthetic_checkpoint.py")
    assert spec is not None and spec.loader is not None
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    out = tmp_path / "cli"
    args = ["--model", "tiny-md3", "--out", str(out), "--seed", "9", "--shards", "2", "--fp8-experts",
            "--kv-scales", "--layout", "internal", "--region-ln", "--quiet"]
    assert cli.main(args + ([] if HAS_TOKENIZER else ["--no-tokenizer"])) == 0
    assert "wrote" in capsys.readouterr().out
    ckpt = HFCheckpoint.open(out, progress=False)
    assert ckpt.config == _expected_config("md3", True)
    assert (ckpt.fp8_experts, ckpt.kv_scales, ckpt.layout) == (True, True, "internal")
    assert cli.main(args + ["--no-tokenizer"]) == 2  # refuses to overwrite without --overwrite
    assert "overwrite" in capsys.readouterr().err


def test_streaming_writer_contract(tmp_path):
    from kestrel_jax.checkpoint.safetensors_io import StreamingWriter

    f = tmp_path / "x.safetensors"
    w = StreamingWriter(f, [("a", "F32", (4, 2)), ("b", "BF16", (3,))])
    with pytest.raises(CheckpointError, match="expected tensor 'a' next"):
        w.write("b", np.zeros(3, ml_dtypes.bfloat16))
    with pytest.raises(CheckpointError, match="declared F32"):
        w.write("a", np.zeros((4, 2), np.float16))
    w.write("a", np.ones((1, 2), np.float32))  # row chunks
    w.write("a", np.ones((3, 2), np.float32))
    with pytest.raises(CheckpointError, match="closed before tensor 'b'"):
        w.close()
    assert not f.exists() and not list(tmp_path.iterdir())  # no half-written file left behind
