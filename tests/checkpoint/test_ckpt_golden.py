"""Reading the golden checkpoints (official reference exports) and the full-size tensor lists."""

from __future__ import annotations

import json

import numpy as np
import pytest
from ckpt_helpers import GOLDEN

from kestrel_jax.checkpoint import HFCheckpoint, expected_tensors, parameter_count
from kestrel_jax.checkpoint import reader as reader_mod
from kestrel_jax.checkpoint.spec import CheckpointError
from kestrel_jax.models.config import config_from_dict, md2_config, md3_1_config, md3_config, tiny_config

pytestmark = pytest.mark.skipif(not (GOLDEN / "md2" / "model.safetensors").is_file(),
                                reason=f"golden checkpoints not found at {GOLDEN} (set KESTREL_GOLDEN_DIR)")


@pytest.mark.parametrize("model", ["md2", "md3"])
def test_golden_config_and_specs(model):
    ckpt = HFCheckpoint.open(GOLDEN / model, progress=False)
    expected = config_from_dict(json.loads((GOLDEN / model / "config.json").read_text()))
    assert ckpt.config == expected
    # The golden sizes are the tiny preset's (name aside).
    assert ckpt.config.text == tiny_config(model).text and ckpt.config.vision == tiny_config(model).vision
    assert (ckpt.fp8_experts, ckpt.kv_scales, ckpt.region_ln, ckpt.layout) == (False, False, False, "hf")
    assert ckpt.assumed == ()
    assert len(ckpt) == {"md2": 392, "md3": 400}[model]  # MANIFEST.md totals
    assert ckpt.names == list(expected_tensors(expected))


@pytest.mark.parametrize("model", ["md2", "md3"])
def test_golden_values_match_safetensors_library(model):
    """Our byte-level reader against the official library's flax loader, bitwise."""
    safe_open = pytest.importorskip("safetensors").safe_open
    path = GOLDEN / model / "model.safetensors"
    ckpt = HFCheckpoint.open(path, progress=False)  # a file path finds config.json beside it
    seen = set()
    with safe_open(str(path), framework="flax") as f:
        for name, arr in ckpt.iter_tensors(progress=False):
            ref = np.asarray(f.get_tensor(f"model.{name}"))
            assert arr.dtype == ref.dtype and arr.shape == ref.shape, name
            assert np.array_equal(arr.view(np.uint16), ref.view(np.uint16)), name
            seen.add(name)
    assert seen == set(ckpt.names)
    assert ckpt.read("text.blocks.3.mlp.fc1.weight").shape == (
        (16, 128, 256) if model == "md3" else (512, 256))


def test_streaming_reads_nothing_during_open_and_one_tensor_per_step(monkeypatch, capsys):
    calls = []
    real = reader_mod.read_range

    def counting(*args, **kwargs):
        calls.append(args[1].name)
        return real(*args, **kwargs)

    monkeypatch.setattr(reader_mod, "read_range", counting)
    ckpt = HFCheckpoint.open(GOLDEN / "md3")
    assert calls == []  # validation touches headers only
    it = ckpt.iter_tensors()
    name, arr = next(it)
    assert len(calls) == 1 and arr.nbytes == ckpt.specs[name].numel * 2
    rest = list(it)
    assert len(calls) == len(ckpt) == 1 + len(rest)
    assert "checkpoint" in capsys.readouterr().err  # tqdm bar on stderr
    list(ckpt.iter_tensors(progress=False))
    assert capsys.readouterr().err == ""


def test_full_size_parameter_counts():
    md3 = parameter_count(expected_tensors(md3_config()))
    md2 = parameter_count(expected_tensors(md2_config()))
    assert abs(md3 - 9.27e9) / 9.27e9 < 2e-3, md3
    assert abs(md2 - 1.93e9) / 1.93e9 < 2e-3, md2
    # MD3 breakdown from MOONDREAM.md §1: MoE ~8.05 B.
    specs = expected_tensors(md3_config())
    moe = sum(s.numel for n, s in specs.items() if len(s.shape) == 3)
    assert abs(moe - 8.05e9) / 8.05e9 < 5e-3, moe
    assert specs["text.blocks.4.mlp.fc1.weight"].shape == (64, 2048, 2048)
    assert specs["text.blocks.4.mlp.fc2.weight"].shape == (64, 2048, 1024)
    assert specs["text.blocks.3.mlp.fc1.weight"].shape == (8192, 2048)
    assert specs["text.blocks.0.attn.tau.wq"].shape == (32, 6144)
    assert specs["region.coord_features"].shape == (1, 128)
    assert specs["region.size_features"].shape == (2, 256)
    assert "region.ln.weight" not in specs and "region.ln.weight" in expected_tensors(md3_1_config())
    md2_specs = expected_tensors(md2_config())
    assert md2_specs["region.coord_decoder.fc1.weight"].shape == (8192, 2048)
    assert md2_specs["region.size_decoder.fc2.weight"].shape == (2048, 8192)


def test_fp8_and_kv_scale_specs():
    specs = expected_tensors(md3_config(), fp8_experts=True, kv_scales=True)
    assert specs["text.blocks.4.mlp.fc1.weight"].dtypes == {"F8_E4M3"}
    assert specs["text.blocks.4.mlp.fc1.scale"].shape == (64, 2048)
    assert specs["text.blocks.4.mlp.fc2.scale"].shape == (64, 2048)
    assert specs["text.blocks.0.attn.k_scale"].shape == ()
    assert "text.blocks.3.mlp.fc1.scale" not in specs  # dense layers are not quantised
    with pytest.raises(CheckpointError, match="MoE"):
        expected_tensors(md2_config(), fp8_experts=True)
    with pytest.raises(CheckpointError, match="MD3"):
        expected_tensors(md2_config(), region_ln=True)
