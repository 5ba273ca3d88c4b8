from __future__ import annotations

import json
from pathlib import Path

import pytest

from kestrel_jax.models.config import (
    ConfigError,
    config_from_dict,
    config_to_dict,
    md2_config,
    md3_1_config,
    md3_config,
    tiny_config,
)
from kestrel_jax.models.moondream import abstract_model, count_params, param_bytes


def test_full_size_models_build_abstractly_with_expected_parameter_counts() -> None:
    md2 = abstract_model(md2_config())
    md3 = abstract_model(md3_config())
    assert abs(count_params(md2) - 1.927e9) / 1.927e9 < 0.01
    assert abs(count_params(md3) - 9.27e9) / 9.27e9 < 0.01
    # FP8 experts: same parameters, about 8 GB less memory.
    md3_fp8 = abstract_model(md3_config(), fp8_experts=True)
    assert count_params(md3_fp8) == count_params(md3)
    assert param_bytes(md3) - param_bytes(md3_fp8) > 7.9e9


def test_md3_1_has_region_layernorm() -> None:
    m = abstract_model(md3_1_config())
    assert m.region.ln is not None
    assert abstract_model(md3_config()).region.ln is None


@pytest.mark.parametrize("arch", ["md2", "md3"])
def test_golden_config_round_trip(golden_dir: Path, arch: str) -> None:
    raw = json.loads((golden_dir / arch / "config.json").read_text())
    cfg = config_from_dict(raw)
    assert cfg.family == arch
    assert cfg.text.dim == 256 and cfg.vision.enc_dim == 64
    assert (cfg.text.moe is not None) == (arch == "md3")
    again = config_from_dict({"config": config_to_dict(cfg)}, family=cfg.family)
    assert again.text == cfg.text and again.vision == cfg.vision and again.tokenizer == cfg.tokenizer


def test_empty_hf_config_falls_back_to_presets() -> None:
    assert config_from_dict({"config": {}}).text == md2_config().text
    assert config_from_dict({"config": {}}, family="md3").text == md3_config().text


def test_invalid_configs_are_rejected() -> None:
    with pytest.raises(ConfigError):
        config_from_dict({"config": {"text": {"dim": 250}}})  # not divisible by 32 heads
    with pytest.raises(ConfigError, match="vocab"):
        config_from_dict({"config": {"text": {"vocab_size": 100}}})  # templates outside vocab
    with pytest.raises(ConfigError):
        config_from_dict({"config": {"vision": {"crop_size": 380}}})


def test_configs_are_hashable_static_arguments() -> None:
    for cfg in (md2_config(), md3_config(), tiny_config("md2"), tiny_config("md3")):
        hash(cfg)


def test_vision_attention_setting() -> None:
    """"auto" is the portable path off a GPU; unknown names are refused."""
    import jax.numpy as jnp
    import pytest

    from kestrel_jax.serving.runner import _vision_attention

    assert _vision_attention("xla", jnp.bfloat16) is None
    assert _vision_attention("cudnn", jnp.bfloat16) == "cudnn"
    assert _vision_attention("auto", jnp.float32) is None
    with pytest.raises(ValueError, match="vision_attention"):
        _vision_attention("flash", jnp.bfloat16)
