"""check_decode_fusion's switch spec (NAME compares 1 against 0, NAME=ON,OFF other values) and a
CPU smoke run on the tiny model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tools.check_decode_fusion import main, switch_values


def test_switch_spec():
    assert switch_values("KESTREL_JAX_TAU_DOTS") == ("KESTREL_JAX_TAU_DOTS", ("1", "0"))
    assert switch_values("KESTREL_JAX_GEMV_QKV_ROWS=64, 1") == ("KESTREL_JAX_GEMV_QKV_ROWS", ("64", "1"))
    for bad in ("TAU_DOTS", "KESTREL_JAX_X=1", "KESTREL_JAX_X=1,2,3", "KESTREL_JAX_X=1,1", "KESTREL_JAX_X=,0"):
        with pytest.raises(SystemExit, match="--switch"):
            switch_values(bad)


def test_tiny_run_with_joined_dense_weights(tmp_path: Path):
    """--tiny --fused-dense-decode: the joined weights are made and both settings of a switch of the
    joined products run (on the CPU the decode GEMM kernel is off, so they agree exactly) on the
    first 2 of the 4 layers, with --logits the LM head's rows too; the switch is restored
    afterwards."""
    out = tmp_path / "check.json"
    spec = "KESTREL_JAX_GEMV_DENSE_OUT=4,0"
    assert main(["--tiny", "--model", "md2", "--fused-dense-decode", "--switch", spec, "--batches", "2",
                 "--context", "40", "--layers", "2", "--logits", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["switches"][spec]["2"]
    assert res["finite"] and res["max_rel"] == 0.0 and res["rms_rel"] == 0.0 and res["max_abs_off"] > 0
    assert res["logits_max_rel"] == 0.0 and res["logits_argmax_equal"] == 2  # --logits: both rows
    assert res["mosaic_calls_on_off"] == [0, 0]  # (no Mosaic GPU kernels on the CPU)
    assert "KESTREL_JAX_GEMV_DENSE_OUT" not in os.environ


def test_layers_keeps_the_first_layers():
    """synthetic_model(layers=N): N decoder layers; MD3's MoE layers start where they did, or at N
    (the tiny MD3's at 2)."""
    from tools.probe_step_kernels import synthetic_model

    md3 = synthetic_model("md3", tiny=True, layers=1).text
    assert len(md3.blocks) == 1 and md3.cfg.n_layers == 1 and md3.cfg.moe is not None
    assert not md3.cfg.is_moe_layer(0)
    md3 = synthetic_model("md3", tiny=True, layers=3).text
    assert len(md3.blocks) == 3 and [md3.cfg.is_moe_layer(i) for i in range(3)] == [False, False, True]
    with pytest.raises(SystemExit):
        main(["--tiny", "--layers", "0"])


def test_side_product_check_small_run(tmp_path: Path):
    """tools/check_side_product.py --small: the interpreted down GEMM with the side product at test
    sizes passes its own checks (rows combine bit-identically, partials sum to the product)."""
    from tools.check_side_product import main as side_main

    out = tmp_path / "side.json"
    assert side_main(["--small", "--tokens", "1", "3", "--out", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert [c["tokens"] for c in cases] == [1, 3] and all(c["rows_equal"] for c in cases)
    assert all(c["side_max_rel"] < 1e-5 for c in cases)
