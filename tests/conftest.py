"""Shared test fixtures. Tests run on the CPU; JAX sees one host device unless a test asks."""

from __future__ import annotations

import os
from pathlib import Path

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
