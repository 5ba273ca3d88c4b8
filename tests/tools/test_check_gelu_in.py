"""tools/check_gelu_in.py on the CPU (interpreted, `--small`): all checks passing and the report
naming what it ran."""

from __future__ import annotations

import json
from pathlib import Path

from tools import check_gelu_in as check


def test_small_run_passes_and_reports(tmp_path: Path):
    out = tmp_path / "check.json"
    assert check.main(["--small", "--draws", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["small"] and res["splits"] == 4
    (case,) = res["cases"]
    assert case["within_rounding"] and case["finite"] and case["equal_to_kernel_on_xla_row"]
    assert case["shape"] == [1, 128]
