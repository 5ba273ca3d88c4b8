"""tests/hang_guard.py: a test that blocks past KESTREL_JAX_TEST_HANG_S ends its process with the
test named and every thread's stack on stderr; a test within the limit is untouched; a bad limit
is a usage error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import hang_guard

HERE = Path(__file__).resolve().parent

_BLOCKS = '''
import threading


def test_quick():
    pass


def test_blocks_forever():
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()  # never returns: no thread will release it
'''


def _pytest(tmp_path: Path, limit: str, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_blocks.py").write_text(_BLOCKS)
    env = {**os.environ, hang_guard.ENV: limit, "PYTHONPATH": str(HERE)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "hang_guard", "-p", "no:cacheprovider",
                           *args, str(tmp_path / "test_blocks.py")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)


def test_a_blocked_test_ends_its_process_named_with_every_stack(tmp_path: Path) -> None:
    run = _pytest(tmp_path, "2")
    assert run.returncode == hang_guard.EXIT_CODE, (run.returncode, run.stdout, run.stderr)
    assert "test_blocks.py::test_blocks_forever still running after 2 s" in run.stderr, run.stderr
    assert "test_blocks_forever" in run.stderr.split("Every thread's stack:", 1)[1]  # its frame in the dump
    assert "test_quick" not in run.stderr


def test_off_and_bad_limits(tmp_path: Path) -> None:
    run = _pytest(tmp_path, "0", "-k", "quick")
    assert run.returncode == 0, (run.stdout, run.stderr)
    for bad in ("soon", "-1"):
        run = _pytest(tmp_path, bad, "-k", "quick")
        assert run.returncode != 0 and hang_guard.ENV in run.stderr + run.stdout, (bad, run.stdout, run.stderr)


def test_under_xdist_the_hung_test_fails_and_the_run_ends(tmp_path: Path) -> None:
    """The README's `-n 2`: the controller reports the ended worker's test as failed and finishes."""
    run = _pytest(tmp_path, "2", "-n", "2")
    assert run.returncode == 1, (run.returncode, run.stdout, run.stderr)
    assert "crashed while running 'test_blocks.py::test_blocks_forever'" in run.stdout, run.stdout
    assert "1 failed, 1 passed" in run.stdout, run.stdout
