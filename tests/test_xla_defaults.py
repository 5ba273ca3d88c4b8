"""Importing kestrel_jax puts the engine's XLA flags into XLA_FLAGS while they can still take
effect, leaves a user's own setting alone, and can be turned off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kestrel_jax import xla_defaults

FLAG = "xla_gpu_command_buffer_update_mode"


def test_adds_the_flag_before_the_backend_starts() -> None:
    env: dict[str, str] = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    assert xla_defaults.apply(env, backend_started=False) == {FLAG: "added"}
    assert env["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=2 --{FLAG}=SKIP_TEMP"
    assert xla_defaults.apply(env, backend_started=False) == {FLAG: "user"}  # idempotent: not added twice
    assert env["XLA_FLAGS"].count(FLAG) == 1
    empty: dict[str, str] = {}
    assert xla_defaults.apply(empty, backend_started=False) == {FLAG: "added"}
    assert empty["XLA_FLAGS"] == f"--{FLAG}=SKIP_TEMP"


def test_keeps_the_users_setting_the_opt_out_and_a_started_backend() -> None:
    env = {"XLA_FLAGS": f"--{FLAG}=ALWAYS_UPDATE"}
    assert xla_defaults.apply(env, backend_started=False) == {FLAG: "user"}
    assert env["XLA_FLAGS"] == f"--{FLAG}=ALWAYS_UPDATE"
    env = {xla_defaults.OPT_OUT: "0"}
    assert xla_defaults.apply(env, backend_started=False) == {FLAG: "off"}
    assert env["XLA_FLAGS"] == ""
    for bad in ("off", "", "2"):
        with pytest.raises(ValueError, match=f"{xla_defaults.OPT_OUT} must be 0 or 1"):
            xla_defaults.apply({xla_defaults.OPT_OUT: bad}, backend_started=False)
    env = {}
    assert xla_defaults.apply(env, backend_started=True) == {FLAG: "late"}  # too late to take effect
    assert env["XLA_FLAGS"] == ""


def _import_in_child(extra_env: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", xla_defaults.OPT_OUT)}
    env.update(extra_env)
    code = ("import os, kestrel_jax\nfrom kestrel_jax import xla_defaults\n"
            "print(xla_defaults.applied(), repr(os.environ.get('XLA_FLAGS')),\n"
            "      xla_defaults.command_buffers_skip_temp())")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip()


def test_importing_the_package_applies_them() -> None:
    assert _import_in_child({}) == f"{{'{FLAG}': 'added'}} '--{FLAG}=SKIP_TEMP' True"
    assert _import_in_child({xla_defaults.OPT_OUT: "0"}) == f"{{'{FLAG}': 'off'}} '' False"
    assert _import_in_child({"XLA_FLAGS": f"--{FLAG}=ALWAYS_UPDATE"}) == \
        f"{{'{FLAG}': 'user'}} '--{FLAG}=ALWAYS_UPDATE' False"


def test_late_import_is_reported() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", xla_defaults.OPT_OUT)}
    code = ("import jax\njax.devices()\nimport kestrel_jax\nfrom kestrel_jax import xla_defaults\n"
            "print(xla_defaults.applied())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         timeout=120).stdout.strip()
    assert out == f"{{'{FLAG}': 'late'}}"
