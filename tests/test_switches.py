"""The trace-time 0 / 1 switches: unset gives the default, 0 and 1 their values, anything else a
clear error naming the switch."""

from __future__ import annotations

import pytest

from kestrel_jax.switches import flag


def test_flag_values_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KESTREL_JAX_TEST_SWITCH", raising=False)
    assert flag("KESTREL_JAX_TEST_SWITCH", True) and not flag("KESTREL_JAX_TEST_SWITCH", False)
    monkeypatch.setenv("KESTREL_JAX_TEST_SWITCH", "0")
    assert not flag("KESTREL_JAX_TEST_SWITCH", True)
    monkeypatch.setenv("KESTREL_JAX_TEST_SWITCH", "1")
    assert flag("KESTREL_JAX_TEST_SWITCH", False)
    for bad in ("2", "on", ""):
        monkeypatch.setenv("KESTREL_JAX_TEST_SWITCH", bad)
        with pytest.raises(ValueError, match="KESTREL_JAX_TEST_SWITCH must be 0 or 1"):
            flag("KESTREL_JAX_TEST_SWITCH", True)
