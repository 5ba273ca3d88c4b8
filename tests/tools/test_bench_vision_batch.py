"""tools/bench_vision_batch.py: the --variants spec parses strictly, and on the CPU a run of two
variants (XLA's default command-buffer types and none) reports one row per variant and image
count with the launch time, and the same tokens from both variants (the option changes how the
step is launched, not what it computes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench_vision_batch import main, parse_variants  # noqa: E402


def test_parse_variants() -> None:
    assert parse_variants(["default", "nocudnn=FUSION,CUBLAS", "off="]) == [
        ("default", None), ("nocudnn", "FUSION,CUBLAS"), ("off", "")]
    for bad in (["cudnn"], ["=FUSION"], ["a=FUSION", "a=CUBLAS"]):
        with pytest.raises(SystemExit):
            parse_variants(bad)


def test_variants_run_and_agree(tmp_path: Path) -> None:
    out = tmp_path / "vb.json"
    assert main(["--model", "tiny-md2", "--images", "1", "2", "--iters", "1", "--reps", "1", "--launch",
                 "--variants", "default", "off=", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["command_buffer"], r["images"]) for r in rows] == [
        ("default", "default", 1), ("default", "default", 2), ("off", "", 1), ("off", "", 2)]
    for r in rows:
        assert r["launch_ms"] > 0 and r["step_ms"] > 0
        assert r["max_rel_diff_vs_first_variant"] == 0.0  # same program on the CPU
        assert r["max_rel_diff_vs_alone"] < 1e-5
