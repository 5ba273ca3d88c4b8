"""Shared test fixtures. Tests run on the CPU; JAX sees one host device unless a test asks.

The README runs the suite in two processes (pytest-xdist, `-n 2`). The scheduler below makes each
test file one unit of work, run whole by one worker, so module-scoped fixtures (engines, compiled
models) are built once, not once per worker; files that share session fixtures form one unit; and
the slowest files are handed out first, so that no worker is left running one alone at the end.

Both workers share one persistent XLA compilation cache for the run (a new temporary folder, removed
at the end): many files compile the same programs for the same tiny models, and the second compile
of a program, in either worker, is a load (6-12% of the suite's time on a 2-core CPU). A user's
JAX_COMPILATION_CACHE_DIR is used instead (and kept). Tests that assert "nothing was compiled"
count cache loads as compiles (tests/serving/conftest.py), so a shared cache cannot hide a
recompile.

Where the time goes (2026-12-07, a whole run under `-n 2` with JAX's monitoring events summed per
file: 2,130 worker-seconds over 1,076 s of wall time): XLA's CPU backend compiles ~1,490 s (the
persistent cache saves another ~620 s), lowering to MLIR ~310 s, tracing ~180 s; the rest runs
the programs, the interpreted kernels' callbacks and the subprocesses. Measured and not used, as
no faster: a lower XLA backend optimisation level (2 or 1: the engine files' compiles no shorter;
0: the engine and CLI files ran 30-90% slower, unoptimised, more than the compile-bound files
gained: 2,330 worker-seconds against 2,168; and a rounding-exact kernel test no longer matched),
one Eigen thread per process, and passing the interpreter's
callbacks their NumPy operands without JAX's device_put (a profile put a sixth of test_moe.py's
time there; measured without the profiler, the bypass was slower: 27.5 s against 24.7 s).
What did cut it (sixty-third session, 1,203 -> 1,023 s wall on the same day's machine): engines
compiling their steps on one thread, the default on a 2-core machine (`default_compile_threads`;
eight threads per worker only contended), and the golden parity's vision stages jitted (op by op
they ran 7-9 s per model)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hang_guard import pytest_runtest_protocol  # noqa: F401 (the hook: a test hung past its limit fails)

REPO = Path(__file__).resolve().parents[1]


def golden_root() -> Path:
    """The shared golden vectors: $KESTREL_GOLDEN_DIR, else <repo>/../shared/golden."""
    env = os.environ.get("KESTREL_GOLDEN_DIR")
    return Path(env) if env else REPO.parent / "shared" / "golden"


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    root = golden_root()
    if not (root / "md2" / "golden.safetensors").exists():
        pytest.fail(f"golden vectors not found at {root}: set KESTREL_GOLDEN_DIR to the shared golden folder")
    return root


# Files that share session-scoped fixtures (tests/serving/conftest.py's engine): one worker runs them,
# so the engine is built once (test_soak.py on a worker of its own built another: 12-17 s).
_ENGINE_GROUP = "serving/test_engine.py+test_server.py+test_soak.py"
SHARED = {"serving/test_engine.py": _ENGINE_GROUP,
          "serving/test_server.py": _ENGINE_GROUP,
          "serving/test_soak.py": _ENGINE_GROUP}
# The slowest files (12 s or more of summed test time each on a 2-core CPU, with the shared compile
# cache), slowest first: longest first keeps the two workers' totals close (replaying three
# session-16 runs' file times: 40-58 s less wall time than the order before). The others follow in
# collection order. A worker takes the next file when it is done with one. Ordered by a full run's
# file times (2026-12-07, sixty-third session, after its trims: 2,020 s summed, 1,023 s wall; the
# workers' totals ended 25 s apart; seconds below).
SLOW_FIRST = (
    "pallas/test_moe.py",  # 223
    "serving/test_engine.py",  # 111; with test_soak.py and test_server.py one unit of work (SHARED): 152
    "serving/test_soak.py",  # before test_server.py, whose last test shuts the shared engine down
    "serving/test_server.py",
    "models/test_fused_dense_decode.py",  # 148
    "test_cli.py",  # 142
    "pallas/test_paged_attention.py",  # 94
    "serving/test_runner_mixed.py",  # 74
    "pallas/test_qkv_epilogue.py",  # 68
    "serving/test_segment.py",  # 66
    "models/test_parity.py",  # 56
    "serving/test_export_cache.py",  # 55
    "tools/test_bench_attention.py",  # 54
    "test_kv_scales.py",  # 50
    "models/test_decode_fusion.py",  # 43
    "pallas/test_gemv.py",  # 43
    "serving/test_multi_device.py",  # 41
    "serving/test_region_gate_engine.py",  # 40
    "pallas/test_sampling.py",  # 40
    "tools/test_benchmark.py",  # 34
    "serving/test_engine_paths.py",  # 33
    "models/test_prefill_qkv_path.py",  # 32
    "serving/test_put_inputs.py",  # 31
    "pallas/test_linear_gelu.py",  # 30
    "serving/test_vision_batches.py",  # 30
    "tools/test_check_decode_fusion.py",  # 23
    "serving/test_defer_unready_images.py",  # 22
    "models/test_dense_residual_in_rows.py",  # 22
    "models/test_region_heads.py",  # 20
    "models/test_loader.py",  # 20
    "models/test_generate.py",  # 19
    "pallas/test_gemv_ln_in_rows.py",  # 18
    "serving/test_admit_before_wait.py",  # 18
    "pallas/test_gemv_residual.py",  # 18
    "pallas/test_lowering_cache.py",  # 17
    "tools/test_bench_vision_batch.py",  # 17
    "pallas/test_mgpu_interpret.py",  # 17
    "pallas/test_layer_norm_blocks.py",  # 16
    "serving/test_vision_thread.py",  # 15
    "models/test_device_crops.py",  # 14
    "test_hang_guard.py",  # 14
    "serving/test_text_steps.py",  # 14
    "tools/test_check_ln_in_rows.py",  # 14
    "serving/test_decode_steps_to_finish.py",  # 13
    "serving/test_runner_vision.py",  # 13
)
TESTS = REPO / "tests"


def _file_key(path: str) -> str:
    """tests/-relative file of a node id or path, through SHARED."""
    rel = path.split("::", 1)[0].removeprefix("tests/")
    return SHARED.get(rel, rel)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slowest files first (a stable sort: each file keeps its own order)."""
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}

    def rank_of(item: pytest.Item) -> int:
        path = item.path
        return rank.get(path.relative_to(TESTS).as_posix(), len(rank)) if path.is_relative_to(TESTS) else len(rank)

    items.sort(key=rank_of)


CACHE_KEY = "kestrel_jax_test_compile_cache"
_CACHE = pytest.StashKey[str]()  # this process's cache folder
_OWNED = pytest.StashKey[str]()  # the folder this process made (and removes)


def pytest_configure(config: pytest.Config) -> None:
    """The run's shared compilation cache: made by the controller (or the only process), handed to
    xdist workers through their workerinput, and switched on in every process that runs tests."""
    worker_input = getattr(config, "workerinput", None)
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        path = os.environ["JAX_COMPILATION_CACHE_DIR"]  # the user's own cache, kept
    elif worker_input is None:  # the controller or a single process: the folder's owner
        path = tempfile.mkdtemp(prefix="kestrel_jax_test_cc_")
        config.stash[_OWNED] = path
    else:  # an xdist worker: the controller's folder (pytest_configure_node)
        path = worker_input[CACHE_KEY]
    config.stash[_CACHE] = path
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config: pytest.Config) -> None:
    owned = config.stash.get(_OWNED, None)
    if owned:
        shutil.rmtree(owned, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: only called with `-n`
def pytest_configure_node(node: Any) -> None:
    path = node.config.stash.get(_CACHE, None)
    if path:
        node.workerinput[CACHE_KEY] = path


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: only called with `-n`
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With `-n N` (and the default `--dist load`): whole files are the units of work (module and
    shared session fixtures are built once), handed out in collection order (slowest first)."""
    if config.getvalue("dist") != "load":
        return None  # an explicit --dist other than the default is honoured
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _file_key(nodeid)

        def remove_node(self, node: Any) -> str | None:
            """As the base class (a crashed worker's unfinished files go back in the queue, the
            first unfinished test is the one that crashed), except that the crashed test is marked
            done before they do: the base class would run it again on each replacement worker, and a
            test that hangs (tests/hang_guard.py ends its worker) would crash them all in turn."""
            workload = self.assigned_work.pop(node)
            pending = [nodeid for unit in workload.values() for nodeid, done in unit.items() if not done]
            if not pending:
                return None
            crashed = pending[0]
            for unit in workload.values():
                if crashed in unit:
                    unit[crashed] = True
            self.workqueue.update({scope: unit for scope, unit in workload.items() if not all(unit.values())})
            for other in self.assigned_work:
                self._reschedule(other)
            return crashed

        def _reschedule(self, node: Any) -> None:
            """As the base class, then more files while the worker has fewer than two tests to run:
            a worker runs a test only once it has the next one (or is told to shut down), so a
            replacement worker handed one file of one test, with more files queued, would wait
            forever (the base class tops a worker up only when it reports a test done)."""
            super()._reschedule(node)
            while self.workqueue and not node.shutting_down and self._pending_of(self.assigned_work[node]) < 2:
                self._assign_work_unit(node)

    config.option.loadscopereorder = False  # keep the slowest-first order of the collection
    return FileScheduling(config, log)
