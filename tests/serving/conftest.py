"""The tiny MD3 engine that test_engine.py, test_soak.py and test_server.py share.

The modules need the same engine (one synthetic checkpoint, one configuration); building it
compiles every step variant at start-up, about a minute on a CPU, so it is built once per test
session and handed to each module. A module that shuts it down (the server's SIGTERM test, last in
its module) leaves the next module a freshly built one, so no module depends on the order they run in.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kestrel_jax.checkpoint.synthetic import write_synthetic_checkpoint
from kestrel_jax.models.config import tiny_config
from kestrel_jax.serving.engine import EngineConfig, InferenceEngine
from kestrel_jax.serving.runner import RunnerConfig


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny MD3 with three text layers (two dense, then one MoE: tiny_config's four repeat a MoE
    layer), so every step the engine compiles at start-up, and the reference, is ~1/6 cheaper."""
    cfg = tiny_config("md3", vision_layers=2)
    cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, n_layers=3)).validate()
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("md3"), cfg, seed=5)


def _engine_config(ckpt: Path) -> EngineConfig:
    return EngineConfig(model_path=str(ckpt), dtype="float32",
                        # crops made on the device: its outputs are checked against the reference, whose
                        # crops are PIL's on the host (test_engine_paths keeps the host path)
                        runner=RunnerConfig(num_pages=96, kv_dtype="f32", max_seq_len=1024, page_size=64,
                                            vision_buckets=(1, 10), device_crops="on"),
                        decode_buckets=(1, 4), prefill_token_buckets=(64, 1024), max_prefill_seqs=4)


@pytest.fixture(scope="session")
def _engines() -> Iterator[list[InferenceEngine]]:
    built: list[InferenceEngine] = []
    yield built
    for eng in built:
        if eng.healthy:
            asyncio.run(eng.shutdown())


@pytest.fixture(scope="module")
def engine(ckpt: Path, _engines: list[InferenceEngine]) -> InferenceEngine:
    """The session's engine, or a new one where an earlier module shut it down."""
    if not _engines or not _engines[-1].healthy:
        _engines.append(asyncio.run(InferenceEngine.create(_engine_config(ckpt))))
    return _engines[-1]


@pytest.fixture
def backend_compiles() -> Callable[[], contextlib.AbstractContextManager[list[str]]]:
    """`with backend_compiles() as seen:` collects the XLA backend compilations that happen inside
    the block (JAX's monitoring events), loads from the persistent compilation cache included: the
    suite shares one (tests/conftest.py), where a recompile would be a load, not a compile (JAX
    0.11 reports a load as a backend compile too; its retrieval event is counted in case not)."""
    import jax

    @contextlib.contextmanager
    def watch() -> Iterator[list[str]]:
        seen: list[str] = []

        def on_duration(event: str, secs: float, **_: object) -> None:
            if "backend_compile" in event or event == "/jax/compilation_cache/cache_retrieval_time_sec":
                seen.append(event)

        jax.monitoring.register_event_duration_secs_listener(on_duration)  # type: ignore[arg-type]
        try:
            yield seen
        finally:
            jax.monitoring.unregister_event_duration_listener(on_duration)  # type: ignore[arg-type]

    return watch
