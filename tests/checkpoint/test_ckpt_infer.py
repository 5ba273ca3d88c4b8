"""Config inference: shapes fill what config.json leaves out; assumptions are reported."""

from __future__ import annotations

import dataclasses
import json

import pytest
from ckpt_helpers import GOLDEN, edit_config

from kestrel_jax.checkpoint import HFCheckpoint, write_synthetic_checkpoint
from kestrel_jax.checkpoint.spec import CheckpointError
from kestrel_jax.models.config import MoEConfig, config_to_dict, md2_config, md3_config, tiny_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = {}
    for family in ("md2", "md3"):
        d = tmp_path_factory.mktemp(f"tiny_{family}")
        out[family] = write_synthetic_checkpoint(d, tiny_config(family), seed=2, tokenizer=False)
    return out


@pytest.mark.parametrize("family", ["md2", "md3"])
def test_empty_config_shapes_win(tiny, family):
    path = tiny[family]
    # Token ids are the one thing a tiny vocabulary cannot take from the full-size preset.
    (path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="outside vocab.*no tokenizer templates"):
        HFCheckpoint.open(path, progress=False)
    tokenizer_only = {"config": {"tokenizer": config_to_dict(tiny_config(family))["tokenizer"]}}
    (path / "config.json").write_text(json.dumps(tokenizer_only))
    ckpt = HFCheckpoint.open(path, progress=False)
    want = tiny_config(family)
    preset = md3_config() if family == "md3" else md2_config()
    # What shapes cannot tell comes from the family preset, and is reported as assumed.
    want = dataclasses.replace(
        want, name=preset.name,
        vision=dataclasses.replace(want.vision, enc_n_heads=preset.vision.enc_n_heads),
        text=dataclasses.replace(want.text, moe=want.text.moe and dataclasses.replace(
            want.text.moe, experts_per_token=MoEConfig().experts_per_token)),
    )
    assert ckpt.config == want
    assumed = {"vision.enc_n_heads", "vision.max_crops", "vision.overlap_margin", "text.max_context"}
    assumed |= {"text.moe.experts_per_token"} if family == "md3" else {"text.n_heads"}
    assert set(ckpt.assumed) == assumed
    # A bare `config` sub-dict works the same.
    (path / "config.json").write_text(json.dumps(tokenizer_only["config"]))
    assert HFCheckpoint.open(path, progress=False).config == want
    (path / "config.json").unlink()  # no config.json at all: like an empty one
    with pytest.raises(CheckpointError, match="outside vocab"):
        HFCheckpoint.open(path, progress=False)


def test_partial_config_and_explicit_path(tiny, tmp_path):
    path = tiny["md3"]
    partial = {"config": {"text": {"moe": {"experts_per_token": 4}}, "vision": {"enc_n_heads": 4},
                          "tokenizer": config_to_dict(tiny_config("md3"))["tokenizer"]},
               "moondream_family": "tiny-md3"}
    cfg_file = tmp_path / "elsewhere.json"
    cfg_file.write_text(json.dumps(partial))
    ckpt = HFCheckpoint.open(path, config_json=cfg_file, progress=False)
    assert ckpt.config == tiny_config("md3")
    assert set(ckpt.assumed) == {"vision.max_crops", "vision.overlap_margin", "text.max_context"}
    with pytest.raises(CheckpointError, match="missing.json"):
        HFCheckpoint.open(path, config_json=tmp_path / "missing.json", progress=False)


def test_inner_config_dict_and_in_channels(tiny, tmp_path):
    """config.json may be the bare `config` sub-dict; a stated in_channels changes the patch size."""
    path = tiny["md2"]
    tok = config_to_dict(tiny_config("md2"))["tokenizer"]
    (path / "config.json").write_text(json.dumps({"text": {"n_layers": 4}, "tokenizer": tok}))
    want = tiny_config("md2")
    want = dataclasses.replace(want, name="moondream2",
                               vision=dataclasses.replace(want.vision, enc_n_heads=16))
    assert HFCheckpoint.open(path, progress=False).config == want
    (path / "config.json").write_text(json.dumps({"text": {"n_layers": 5}}))
    with pytest.raises(CheckpointError, match=r"text.n_layers = 5.*text.blocks.3"):
        HFCheckpoint.open(path, progress=False)
    # 588 = 12 * 7 * 7: patch 7, so a 27-wide grid means 189 px crops.
    (path / "config.json").write_text(json.dumps({"vision": {"in_channels": 12}, "tokenizer": tok}))
    cfg = HFCheckpoint.open(path, progress=False).config.vision
    assert (cfg.in_channels, cfg.enc_patch_size, cfg.crop_size, cfg.grid_size) == (12, 7, 189, 27)
    (path / "config.json").write_text(json.dumps({"vision": {"in_channels": 5}, "tokenizer": tok}))
    with pytest.raises(CheckpointError, match=r"vision.patch_emb.weight.*\[64, 588\], expected \[64, 980\]"):
        HFCheckpoint.open(path, progress=False)


def test_golden_with_stripped_config(tmp_path):
    if not (GOLDEN / "md3" / "model.safetensors").is_file():
        pytest.skip(f"golden checkpoints not found at {GOLDEN}")
    cfg = json.loads((GOLDEN / "md3" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    edit_config(tmp_path, lambda c: [c["config"]["text"].pop(k) for k in ("dim", "n_layers", "vocab_size")])
    full = HFCheckpoint.open(GOLDEN / "md3", progress=False).config
    got = HFCheckpoint.open(GOLDEN / "md3" / "model.safetensors", config_json=tmp_path / "config.json",
                            progress=False).config
    assert got == full
