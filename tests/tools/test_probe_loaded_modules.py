"""tools/probe_loaded_modules.py's profiler ranges, against a stand-in for the CUDA driver."""

from __future__ import annotations

from typing import Any

import pytest

from tools import probe_loaded_modules as tool


class FakeDriver:
    def __init__(self, fail: str | None = None) -> None:
        self.calls: list[str] = []
        self.fail = fail

    def __getattr__(self, name: str) -> Any:
        def call(*_: object) -> int:
            self.calls.append(name)
            return 201 if name == self.fail else 0
        return call


def test_ranges_bind_the_primary_context_then_start_or_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    drv = FakeDriver()
    monkeypatch.setattr(tool.ctypes, "CDLL", lambda name: drv)
    tool.profiler(True)
    tool.profiler(False)
    bind = ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent"]
    assert drv.calls == [*bind, "cuProfilerStart", *bind, "cuProfilerStop"]
    assert tool.parse_args(["--profiler-ranges"]).profiler_ranges and not tool.parse_args([]).profiler_ranges


def test_driver_errors_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    drv = FakeDriver(fail="cuProfilerStart")
    monkeypatch.setattr(tool.ctypes, "CDLL", lambda name: drv)
    with pytest.raises(RuntimeError, match="cuProfilerStart returned CUDA error 201"):
        tool.profiler(True)

    def missing(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(tool.ctypes, "CDLL", missing)
    with pytest.raises(RuntimeError, match="needs the CUDA driver"):
        tool.profiler(False)
