"""A sampling profiler for one Python thread (the engine's), for benchmark runs.

A daemon thread reads the target thread's current frame every `interval_s` and counts where it
is: the innermost frame, and the innermost frame inside the `kestrel_jax` package (which of our
calls the time belongs to). Sampling costs the target thread nothing but the GIL hand-offs, so
unlike cProfile it does not change where the time goes. Each sample is weighted by the time since
the previous one: while the target runs Python it holds the GIL and the sampler waits up to the
interpreter's switch interval (5 ms) for its next look, so counting samples alone would
under-weight Python code against calls that release the GIL. Stdlib only.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import defaultdict
from types import FrameType
from typing import Any


def _where(frame: FrameType) -> str:
    code = frame.f_code
    path = code.co_filename
    short = path.split("site-packages/")[-1] if "site-packages/" in path else path.split("/")[-1]
    return f"{short}:{frame.f_lineno} {code.co_name}"


class ThreadSampler:
    def __init__(self, thread: threading.Thread, interval_s: float = 0.0005, package: str = "kestrel_jax"):
        self.thread = thread
        self.interval_s = interval_s
        self.package = package
        self.leaf: defaultdict[str, float] = defaultdict(float)  # seconds attributed to each place
        self.ours: defaultdict[str, float] = defaultdict(float)
        self.samples = 0
        self.seconds = 0.0
        self._stop = threading.Event()
        self._runner = threading.Thread(target=self._run, name="host-sampler", daemon=True)

    def __enter__(self) -> ThreadSampler:
        self._runner.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._runner.join()

    def _run(self) -> None:
        tid = self.thread.ident
        last = time.perf_counter()
        while not self._stop.is_set():
            frame = sys._current_frames().get(tid) if tid is not None else None
            now = time.perf_counter()
            weight, last = now - last, now
            if frame is not None:
                self.samples += 1
                self.seconds += weight
                self.leaf[_where(frame)] += weight
                f: FrameType | None = frame
                while f is not None and f"/{self.package}/" not in f.f_code.co_filename:
                    f = f.f_back
                self.ours[_where(f) if f is not None else "(outside the package)"] += weight
            time.sleep(self.interval_s)

    def summary(self, top: int = 25) -> dict[str, Any]:
        """Fractions of the sampled time, largest first."""
        total = self.seconds or 1.0

        def table(c: dict[str, float]) -> list[tuple[str, float]]:
            return [(k, round(v / total, 4)) for k, v in sorted(c.items(), key=lambda kv: -kv[1])[:top]]

        return {"samples": self.samples, "seconds": round(self.seconds, 3), "innermost": table(self.leaf),
                "innermost_in_package": table(self.ours)}
