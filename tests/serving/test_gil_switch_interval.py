"""EngineConfig.gil_switch_interval_ms: set while the engine runs, restored when it stops, checked."""

from __future__ import annotations

import asyncio
import sys

import jax.numpy as jnp
import pytest

from kestrel_jax.models.config import tiny_config
from kestrel_jax.models.moondream import random_model
from kestrel_jax.serving.engine import EngineConfig, InferenceEngine
from kestrel_jax.serving.runner import RunnerConfig
from kestrel_jax.tokenizer import Tokenizer, build_synthetic_tokenizer


def _config(ms: float | None) -> EngineConfig:
    return EngineConfig(runner=RunnerConfig(num_pages=16, kv_dtype="f32", max_seq_len=1024), decode_buckets=(1,),
                        prefill_token_buckets=(1024,), max_prefill_seqs=1, warmup=False, vision_thread=False,
                        gil_switch_interval_ms=ms)


def test_set_while_running_and_restored() -> None:
    model = random_model(tiny_config("md2", vision_layers=1), dtype=jnp.float32, seed=3)
    tok = Tokenizer(build_synthetic_tokenizer(model.cfg.text.vocab_size))
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.004)
        eng = asyncio.run(InferenceEngine.create(_config(0.25), model=model, tokenizer=tok))
        try:
            assert sys.getswitchinterval() == pytest.approx(0.00025)
        finally:
            asyncio.run(eng.shutdown())
        assert sys.getswitchinterval() == pytest.approx(0.004)
        eng = asyncio.run(InferenceEngine.create(_config(None), model=model, tokenizer=tok))  # None: untouched
        try:
            assert sys.getswitchinterval() == pytest.approx(0.004)
        finally:
            asyncio.run(eng.shutdown())
        assert sys.getswitchinterval() == pytest.approx(0.004)
        for bad in (0.0, -1.0, 5000.0):
            with pytest.raises(ValueError, match="gil_switch_interval_ms"):
                asyncio.run(InferenceEngine.create(_config(bad), model=model, tokenizer=tok))
        assert sys.getswitchinterval() == pytest.approx(0.004)
    finally:
        sys.setswitchinterval(before)
