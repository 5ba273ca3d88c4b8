"""Trace-time A/B switches from the environment (`KESTREL_JAX_*`, 0 or 1): read where a step or a
kernel entry point is traced, so each compiled program bakes in its value (the exported steps' key
includes every `KESTREL_JAX_*` variable)."""

from __future__ import annotations

import os


def flag(name: str, default: bool) -> bool:
    """The 0 / 1 switch `name` (unset: `default`); any other value is a clear error."""
    value = os.environ.get(name, "1" if default else "0")
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"
