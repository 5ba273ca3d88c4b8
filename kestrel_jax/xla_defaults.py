"""XLA settings the engine runs best with, put into `XLA_FLAGS` before JAX starts its backend.

`--xla_gpu_command_buffer_update_mode=SKIP_TEMP`: XLA replays each step as a command buffer (a
CUDA graph) that records every kernel's buffer addresses, and by default it updates the graph's
nodes on every call whose temporary buffer landed at another address than last time. With
pipelined steps of several programs in flight, it usually does: on the H100 the engine thread
spent ~1.25 ms per text-step command buffer and the vision thread ~5.9 ms per vision call in
those updates (BENCHMARKS.md, twenty-ninth session). SKIP_TEMP makes the GPU client use XLA's virtual-memory
allocator and gives each program's temporaries one reserved virtual range, so only the nodes
that read a step's inputs or write its outputs are updated: W2's mixed-step launch went from
7.2-7.8 to 3.1-4.6 ms of host time and 64-client output tokens/s up 7.6% (mean of three
same-machine pairs).

The flag is added when `kestrel_jax` is imported, unless `XLA_FLAGS` already names it, the
environment sets `KESTREL_JAX_XLA_DEFAULTS=0`, or JAX's backend is already running (then it
cannot take effect; `applied()` says which, and the engine logs it). With the VMM allocator
`Device.memory_stats()` returns None; the runner then sizes the KV pool from the driver's total
memory and the live arrays instead (`runner.gpu_memory_info`, `runner.live_bytes`).
"""

from __future__ import annotations

import os
import sys

DEFAULTS: dict[str, str] = {"xla_gpu_command_buffer_update_mode": "SKIP_TEMP"}
OPT_OUT = "KESTREL_JAX_XLA_DEFAULTS"

_state: dict[str, str] = {}  # flag -> "added" | "user" (XLA_FLAGS named it) | "late" | "off"


def apply(environ: dict[str, str] | os._Environ[str] | None = None, backend_started: bool | None = None
          ) -> dict[str, str]:
    """Add the defaults to `XLA_FLAGS` where they can still take effect; returns what happened to
    each flag (see `_state`). Idempotent."""
    env = os.environ if environ is None else environ
    if backend_started is None:
        backend_started = _backend_started()
    out: dict[str, str] = {}
    flags = env.get("XLA_FLAGS", "")
    for name, value in DEFAULTS.items():
        if _flag_value(name, flags) is not None:  # the user's setting, or ours from an earlier call
            out[name] = "added" if _state.get(name) == "added" and environ is None else "user"
        elif not _enabled(env):
            out[name] = "off"
        elif backend_started:
            out[name] = "late"
        else:
            flags = f"{flags} --{name}={value}".strip()
            out[name] = "added"
    env["XLA_FLAGS"] = flags
    if environ is None:
        _state.update(out)
    return out


def _enabled(env: dict[str, str] | os._Environ[str]) -> bool:
    value = env.get(OPT_OUT, "1")
    if value not in ("0", "1"):  # the project's switch convention (switches.py)
        raise ValueError(f"{OPT_OUT} must be 0 or 1, got {value!r}")
    return value == "1"


def applied() -> dict[str, str]:
    """What `apply` did at import (empty if it never ran)."""
    return dict(_state)


def command_buffers_skip_temp() -> bool:
    """Whether XLA_FLAGS asks for SKIP_TEMP now (the backend reads it once, when it starts)."""
    return _flag_value("xla_gpu_command_buffer_update_mode") == "SKIP_TEMP"


def _flag_value(name: str, flags: str | None = None) -> str | None:
    """The value `flags` (default: XLA_FLAGS now) gives the flag, or None if it does not name it."""
    for tok in (os.environ.get("XLA_FLAGS", "") if flags is None else flags).split():
        key, _, value = tok.lstrip("-").partition("=")
        if key == name:
            return value
    return None


def _backend_started() -> bool:
    # Read from sys.modules, not imported: JAX not imported means no backend, and the host-side
    # serving modules (scheduler, pages) must stay importable without JAX.
    xla_bridge = sys.modules.get("jax._src.xla_bridge")
    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started()) if callable(started) else False
