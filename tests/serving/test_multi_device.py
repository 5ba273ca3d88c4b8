"""One engine worker per device (`EngineConfig.num_devices`), on two host CPU devices in a process
of their own: the requests give the same outputs as a one-device engine (placed on device 1 with
`RunnerConfig.device`), each device holds its own params and serves requests, an image's queries
share its device's prefix cache, cancellation reaches the right device, and nothing is left held."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent


def test_two_devices_serve_like_one(ckpt: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    images = []
    for i in range(2):
        p = tmp_path / f"{i}.png"
        Image.fromarray(rng.integers(0, 255, (300, 300, 3), dtype=np.uint8)).save(p)
        images.append(str(p))
    env = {**os.environ, "PYTHONPATH": str(HERE.parents[1])}
    env.pop("XLA_FLAGS", None)
    # The run's compilation cache (tests/conftest.py): the one-device engine on device 1 loads the
    # programs the two-device engine compiled for that device (on a CPU a program's cache key
    # includes its device), in place of compiling them again.
    if jax.config.jax_compilation_cache_dir:
        env.update(JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir,
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    proc = subprocess.run([sys.executable, str(HERE / "multi_device_run.py"), str(ckpt), *images], env=env,
                          capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    out = json.loads(line.removeprefix("RESULT "))
    two, one = out["two"], out["one"]
    assert two["outputs"] == one["outputs"]
    assert two["cancelled"] == one["cancelled"] == "cancelled"
    assert [d["params_on"] for d in two["devices"]] == [["cpu:0"], ["cpu:1"]]
    assert [d["params_on"] for d in one["devices"]] == [["cpu:1"]]
    assert all(d["admitted"] > 0 for d in two["devices"]), two["devices"]  # both devices served
    assert sum(d["admitted"] for d in two["devices"]) == 8
    # the stream's cancel() and the timed-out caller's request, each on the device that held it
    assert sum(d["cancelled"] for d in two["devices"]) == 2 == one["devices"][0]["cancelled"]
    assert sum(d["hits"] for d in two["devices"]) >= 1  # image 0's second query found its prefix
    assert two["live"] == 0 and all(d["live"] == 0 for d in two["devices"])
    assert two["max_requests"] == 2 * one["max_requests"]
