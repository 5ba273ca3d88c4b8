"""A pytest plugin that turns a hung test into a failure: a test still running after
KESTREL_JAX_TEST_HANG_S seconds (default 900; 0 turns the guard off) is taken for hung. The guard
writes the test's id and every thread's Python stack to the process's stderr, outside pytest's
capture, and ends the process. Under pytest-xdist the controller then reports the worker as crashed
while running that test, fails the test, and goes on with a fresh worker: CI ends with the hang named
instead of running into its time limit.

Why: a model test hung in two CI runs of the fifty-fourth session's code: JAX's Mosaic GPU
interpreter dispatched JAX ops inside its callbacks, which deadlocked against the test's own
dispatches (worked around since: kestrel_jax/pallas/mgpu_interpret.py). A hang cannot be interrupted
from Python, so the process ends.

Registered by tests/conftest.py; tests/test_hang_guard.py runs it on a test that blocks."""

from __future__ import annotations

import faulthandler
import os
import threading
from collections.abc import Generator

import pytest

ENV = "KESTREL_JAX_TEST_HANG_S"
EXIT_CODE = 70  # what a process the guard ends exits with


def limit_s() -> float:
    """The guard's limit in seconds (0: off), from KESTREL_JAX_TEST_HANG_S."""
    raw = os.environ.get(ENV, "900")
    try:
        value = float(raw)
    except ValueError:
        raise pytest.UsageError(f"{ENV} must be a number of seconds, got {raw!r}") from None
    if value < 0:
        raise pytest.UsageError(f"{ENV} must be >= 0, got {raw!r}")
    return value


def _hung(config: pytest.Config, nodeid: str, limit: float) -> None:
    capman = config.pluginmanager.getplugin("capturemanager")
    try:  # write to the real stderr, not the test's captured one (lost when the process ends)
        if capman is not None:
            capman.suspend_global_capture(in_=False)
    except Exception:  # noqa: BLE001 (best effort: the dump below goes to fd 2 either way)
        pass
    os.write(2, f"\n{nodeid} still running after {limit:g} s ({ENV}): taken for hung; its process "
                f"ends. Every thread's stack:\n".encode())
    faulthandler.dump_traceback(file=2, all_threads=True)
    os._exit(EXIT_CODE)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    limit = limit_s()
    if not limit:
        yield
        return
    timer = threading.Timer(limit, _hung, args=(item.config, item.nodeid, limit))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
