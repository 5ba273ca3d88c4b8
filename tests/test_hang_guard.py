"""tests/hang_guard.py: a test that blocks past KESTREL_JAX_TEST_HANG_S ends its process with the
test named and every thread's stack on stderr; a test within the limit is untouched; a bad limit
is a usage error. Under xdist with tests/conftest.py's file scheduler the run then goes on."""

from __future__ import annotations

import os
import shutil
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


def test_under_xdist_the_hung_test_fails_and_the_run_goes_on(tmp_path: Path) -> None:
    """The README's `-n 2` with this suite's conftest (its file scheduler): the controller fails the
    ended worker's test, does not run it again, and a replacement worker runs the tests after it
    and the files queued behind it."""
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_blocks.py").write_text(_BLOCKS + "\n\ndef test_after():\n    pass\n")
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    (tmp_path / "test_two.py").write_text("def test_two_a():\n    pass\n\n\ndef test_two_b():\n    pass\n")
    env = {**os.environ, hang_guard.ENV: "3", "PYTHONPATH": str(HERE)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", "-rA",
                          "test_blocks.py", "test_one.py", "test_two.py"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=180)
    assert run.returncode == 1, (run.returncode, run.stdout, run.stderr)
    assert "crashed while running 'test_blocks.py::test_blocks_forever'" in run.stdout, run.stdout
    assert "1 failed, 5 passed" in run.stdout, run.stdout
    assert run.stderr.count("taken for hung") == 1, run.stderr  # not run again
    assert "PASSED test_blocks.py::test_after" in run.stdout, run.stdout
