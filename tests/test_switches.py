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


def test_integer_and_choice_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    from kestrel_jax.switches import choice, integer

    name = "KESTREL_JAX_TEST_SWITCH"
    monkeypatch.delenv(name, raising=False)
    assert integer(name, 14, high=31) == 14 and choice(name, "poly", ("poly", "exact")) == "poly"
    monkeypatch.setenv(name, "31")
    assert integer(name, 14, high=31) == 31
    for bad in ("32", "-1", "on", "", "1.5"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"{name} must be an integer"):
            integer(name, 14, high=31)
    monkeypatch.setenv(name, "0")
    with pytest.raises(ValueError, match=r"\[2, 8\]"):
        integer(name, 4, low=2, high=8)
    monkeypatch.setenv(name, "exact")
    assert choice(name, "poly", ("poly", "exact")) == "exact"
    monkeypatch.setenv(name, "EXACT")
    with pytest.raises(ValueError, match=f"{name} must be one of poly, exact"):
        choice(name, "poly", ("poly", "exact"))


@pytest.mark.parametrize("switch,bad", [("KESTREL_JAX_MOE_PDL", "yes"), ("KESTREL_JAX_QUANT_KERNEL", "off"),
                                        ("KESTREL_JAX_TAU_GELU", "erf")])
def test_loosely_read_switches_now_refuse_unknown_values(monkeypatch: pytest.MonkeyPatch, switch: str,
                                                          bad: str) -> None:
    """Switches once read as `== "1"` / `!= "0"` took any other value silently as the default."""
    from kestrel_jax.pallas import moe_mgpu, ops

    read = {"KESTREL_JAX_MOE_PDL": moe_mgpu.pdl_wanted, "KESTREL_JAX_QUANT_KERNEL": moe_mgpu.quantize_kernel_wanted,
            "KESTREL_JAX_TAU_GELU": lambda: ops.tau_gelu()}[switch]
    monkeypatch.setenv(switch, bad)
    with ops.use_backend("kernel"), pytest.raises(ValueError, match=switch):
        read()
