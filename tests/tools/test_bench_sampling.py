"""tools/bench_sampling.py on the CPU (--cpu-smoke: the interpreted kernel, V = 4096): a run of two
settings checks the kernel against `sample_reference` ("ok", no token mismatches), times the
kernel and its baselines (argmax for greedy rows, the sort-based sampler and categorical for
top-p), writes one JSON case per (batch, setting, implementation) and exits 0; `--settings`
keeps only the named settings and refuses unknown ones."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools import bench_sampling  # noqa: E402


def _main(monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    monkeypatch.setattr(sys, "argv", ["bench_sampling.py", "--cpu-smoke", "--seed", "7", *args])
    return bench_sampling.main()


def test_cpu_smoke_run_checks_and_times_each_case(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    out = tmp_path / "sampling.json"
    assert _main(monkeypatch, "--batches", "1", "--settings", "greedy,top_p", "--out", str(out)) == 0
    res = json.loads(out.read_text())
    assert res["mode"] == "cpu-smoke" and res["vocab"] == 4096 and res["batches"] == [1]
    assert sorted(res["settings"]) == ["greedy", "top_p"]
    cases = {(c["setting"], c["impl"]): c for c in res["cases"]}
    assert sorted(cases) == [("greedy", "argmax"), ("greedy", "kernel"), ("greedy", "sort_top_p"),
                             ("top_p", "categorical"), ("top_p", "kernel"), ("top_p", "sort_top_p")]
    for (_setting, impl), c in cases.items():
        assert "error" not in c, c
        assert c["us"] > 0 and c["method"] == "host" and c["batch"] == 1
        if impl == "kernel":
            assert c["check"] == "ok" and c["token_mismatches"] == 0 and c["rows_checked"] == 1, c


def test_unknown_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit, match="unknown settings"):
        _main(monkeypatch, "--batches", "1", "--settings", "greedy,bogus")
