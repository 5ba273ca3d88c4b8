"""tools/check_ln_in_rows.py on the CPU (interpreted, `--small`): the MoE layer's pair with tau dots and
the dense layer's joined product (with the previous layer's residual added in the kernel too), the
tiles formed in the loop and ahead, all checks passing, and the report naming what it ran."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools import check_ln_in_rows as check


@pytest.mark.parametrize("extra", [[], ["--dense"], ["--ahead"], ["--dense", "--residual"]])
def test_small_run_passes_and_reports(tmp_path: Path, extra: list[str]):
    out = tmp_path / "check.json"
    assert check.main(["--small", "--draws", "1", "--out", str(out), *extra]) == 0
    res = json.loads(out.read_text())
    assert res["small"] and res["dense"] == ("--dense" in extra) and res["ahead"] == ("--ahead" in extra)
    (case,) = res["cases"]
    assert all(case[k] for k in ("ln_within_one_rounding", "padding_rows_zero", "products_equal", "finite"))
    assert res["residual"] == ("--residual" in extra)
    if res["residual"]:
        assert all(case[k] for k in ("row0_equals_padded", "residual_exact", "ln_and_products_equal_fed_the_row"))


def test_residual_needs_dense():
    with pytest.raises(SystemExit):
        check.main(["--small", "--draws", "1", "--residual"])
