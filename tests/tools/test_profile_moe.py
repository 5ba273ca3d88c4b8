"""The MoE profiling driver: case specs become the default config with typed overrides; a tiny
interpreted run goes through every case."""

from __future__ import annotations

import pytest

from tools.profile_moe import case_config, main


def test_case_specs_override_the_default_config():
    T, cfg = case_config("1480:block_tokens=64:w8a8=0", num_ctas=132)
    assert T == 1480 and cfg.block_tokens == 64 and cfg.w8a8 is False and not cfg.dense
    T, cfg = case_config("8")
    assert T == 8 and cfg.dense
    with pytest.raises(SystemExit, match="unknown MoEKernelConfig field"):
        case_config("100:bogus=1")


def test_small_run_goes_through_each_case(capsys):
    assert main(["--small", "40", "100:block_tokens=128"]) == 0
    out = capsys.readouterr().out
    assert "40: 1 calls done" in out and "100:block_tokens=128: 1 calls done" in out
