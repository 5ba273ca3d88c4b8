"""The command line end to end, on the synthetic demo model (subprocesses, as a user runs it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _run(args: list[str], cache: Path, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, KESTREL_JAX_CACHE=str(cache))
    return subprocess.run([sys.executable, "-m", "kestrel_jax", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def test_demo_runs_every_skill_and_says_weights_are_random(cache: Path) -> None:
    p = _run(["demo", "--max-tokens", "3", "--max-objects", "1"], cache)
    assert p.returncode == 0, p.stderr[-3000:]
    for skill in ("caption", "query", "query (reasoning)", "detect", "point"):
        assert f"[demo] {skill}" in p.stdout, p.stdout
    assert "RANDOM weights" in p.stderr and "noise" in p.stdout
    assert (cache / "demo-tiny-md3-v2" / ".complete").exists()
    # the compiled steps are kept for the next command (the tests below load them)
    compiled = [f for f in (cache / "compile").rglob("*") if f.is_file()]
    assert compiled and any(f.suffix == ".jaxexport" for f in compiled)


def test_detect_json_output(cache: Path) -> None:
    p = _run(["detect", "car", "--json", "--quiet", "--max-objects", "2"], cache)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert isinstance(out["objects"], list) and len(out["objects"]) <= 2
    for box in out["objects"]:
        assert set(box) == {"x_min", "y_min", "x_max", "y_max"}


def test_bad_input_gives_a_clear_error_not_a_traceback(cache: Path, tmp_path: Path) -> None:
    bad = tmp_path / "not_an_image.png"
    bad.write_bytes(b"this is not an image")
    p = _run(["caption", "--image", str(bad), "--quiet"], cache)
    assert p.returncode == 2
    assert "kestrel-jax: error:" in p.stderr and "Traceback" not in p.stderr
    p = _run(["query", "--quiet", "--temperature", "-1", "hi"], cache)
    assert p.returncode == 2 and "temperature" in p.stderr
    p = _run(["caption", "--model", str(tmp_path / "missing")], cache)
    assert p.returncode == 2 and "no such checkpoint" in p.stderr
