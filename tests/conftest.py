"""Shared test fixtures. Tests run on the CPU; JAX sees one host device unless a test asks.

The README runs the suite in two processes (pytest-xdist, `-n 2`). The scheduler below makes each
test file one unit of work, run whole by one worker, so module-scoped fixtures (engines, compiled
models) are built once, not once per worker; files that share session fixtures form one unit; and
the slowest files are handed out first, so that no worker is left running one alone at the end."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


def golden_root() -> Path:
    """The shared golden vectors: $KESTREL_GOLDEN_DIR, else <repo>/../shared/golden."""
    env = os.environ.get("KESTREL_GOLDEN_DIR")
    return Path(env) if env else REPO.parent / "shared" / "golden"


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    root = golden_root()
    if not (root / "md2" / "golden.safetensors").exists():
        pytest.fail(f"golden vectors not found at {root}: set KESTREL_GOLDEN_DIR to the shared golden folder")
    return root


# Files that share session-scoped fixtures (tests/serving/conftest.py's engine): one worker runs them.
SHARED = {"serving/test_engine.py": "serving/test_engine.py+test_server.py",
          "serving/test_server.py": "serving/test_engine.py+test_server.py"}
# The slowest files (a minute or more each on a 2-core CPU), slowest first; the others follow in
# collection order. A worker takes the next file when it is done with one.
SLOW_FIRST = (
    "serving/test_engine.py",
    "serving/test_server.py",
    "pallas/test_moe.py",
    "test_cli.py",
    "models/test_parity.py",
    "serving/test_engine_paths.py",
    "serving/test_vision_thread.py",
    "serving/test_runner_vision.py",
    "serving/test_vision_batches.py",
    "serving/test_runner_mixed.py",
    "pallas/test_paged_attention.py",
    "pallas/test_sampling.py",
    "models/test_generate.py",
    "tools/test_benchmark.py",
    "models/test_loader.py",
)
TESTS = REPO / "tests"


def _file_key(path: str) -> str:
    """tests/-relative file of a node id or path, through SHARED."""
    rel = path.split("::", 1)[0].removeprefix("tests/")
    return SHARED.get(rel, rel)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slowest files first (a stable sort: each file keeps its own order)."""
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}

    def rank_of(item: pytest.Item) -> int:
        path = item.path
        return rank.get(path.relative_to(TESTS).as_posix(), len(rank)) if path.is_relative_to(TESTS) else len(rank)

    items.sort(key=rank_of)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: only called with `-n`
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With `-n N` (and the default `--dist load`): whole files are the units of work (module and
    shared session fixtures are built once), handed out in collection order (slowest first)."""
    if config.getvalue("dist") != "load":
        return None  # an explicit --dist other than the default is honoured
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _file_key(nodeid)

    config.option.loadscopereorder = False  # keep the slowest-first order of the collection
    return FileScheduling(config, log)
