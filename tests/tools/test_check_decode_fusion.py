"""check_decode_fusion's switch spec: NAME compares 1 against 0, NAME=ON,OFF other values."""

from __future__ import annotations

import pytest

from tools.check_decode_fusion import switch_values


def test_switch_spec():
    assert switch_values("KESTREL_JAX_TAU_DOTS") == ("KESTREL_JAX_TAU_DOTS", ("1", "0"))
    assert switch_values("KESTREL_JAX_GEMV_QKV_ROWS=64, 1") == ("KESTREL_JAX_GEMV_QKV_ROWS", ("64", "1"))
    for bad in ("TAU_DOTS", "KESTREL_JAX_X=1", "KESTREL_JAX_X=1,2,3", "KESTREL_JAX_X=1,1", "KESTREL_JAX_X=,0"):
        with pytest.raises(SystemExit, match="--switch"):
            switch_values(bad)
