"""Trace-time A/B switches from the environment (`KESTREL_JAX_*`): read where a step or a kernel
entry point is traced, so each compiled program bakes in its value (the exported steps' key
includes every `KESTREL_JAX_*` variable). Unset gives the default; a value outside the switch's
range is a clear error naming the switch, never a silent default."""

from __future__ import annotations

import os


def flag(name: str, default: bool) -> bool:
    """The 0 / 1 switch `name` (unset: `default`); any other value is a clear error."""
    value = os.environ.get(name, "1" if default else "0")
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def integer(name: str, default: int, *, low: int = 0, high: int | None = None) -> int:
    """The non-negative integer switch `name` in [low, high] (unset: `default`)."""
    value = os.environ.get(name)
    if value is None:
        return default
    if not value.isdigit() or int(value) < low or (high is not None and int(value) > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")
    return int(value)


def choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """The switch `name`, one of `choices` (unset: `default`)."""
    value = os.environ.get(name, default)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value
