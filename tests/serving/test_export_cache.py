"""Decode and prefill steps kept as jax.export files next to the compilation cache: a second runner
loads them instead of tracing and lowering, with the same outputs; a broken file falls back."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from kestrel_jax.models.config import tiny_config
from kestrel_jax.models.moondream import MoondreamModel, random_model
from kestrel_jax.serving import batch as bt
from kestrel_jax.serving.runner import Runner, RunnerConfig


@pytest.fixture(scope="module")
def model() -> MoondreamModel:
    return random_model(tiny_config("md3", vision_layers=2), dtype=jnp.float32, seed=3)


@pytest.fixture(scope="module")
def plain(model: MoondreamModel) -> list[np.ndarray]:
    """`_run` on a runner without the export cache (plain jit): what every runner below must give."""
    return _run(Runner(model, _config(None)))


@pytest.fixture(scope="module")
def exported(model: MoondreamModel, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[np.ndarray]]:
    """A cache folder after a first runner's `_run` with the export cache (its three steps exported,
    their programs in the compilation cache beside them), and that run's outputs. The tests below
    that began with such a run start from a copy of the folder instead (`_from_exported`)."""
    cache = tmp_path_factory.mktemp("exported")
    first = Runner(model, _config(cache))
    got = _run(first)
    assert first.export_counts == {"loaded": 0, "exported": 3, "fallback": 0}  # prefill, decode1, decode2
    return cache, got


def _from_exported(exported: tuple[Path, list[np.ndarray]], dst: Path) -> None:
    """`dst` as the first run left its cache folder: the exports and compiled programs, copied."""
    shutil.copytree(exported[0], dst, dirs_exist_ok=True)


def _config(cache: Path | None, **kw: object) -> RunnerConfig:
    settings: dict[str, Any] = dict(num_pages=8, kv_dtype="f32", max_seq_len=256, page_size=64, vision_buckets=(2,),
                                    compilation_cache_dir=None if cache is None else str(cache))
    return RunnerConfig(**{**settings, **kw})


def _run(runner: Runner) -> list[np.ndarray]:
    """A 5-token text prefill into page 2, then two decode launches (1 and 2 iterations) of it."""
    p = runner.max_pages_per_seq
    tok_ints, tok_floats, seq_ints, seq_floats = bt.empty_prefill(16, 2, p)
    n = 5
    tok_ints[:n, bt.T_POS] = np.arange(n)
    tok_ints[:n, bt.T_SLOT] = 2 * runner.page_size + np.arange(n)
    tok_ints[:n, bt.T_TOKEN] = [1, 700, 33, 4000, 12]
    tok_ints[:, bt.T_NUM_VALID] = n
    seq_ints[:, bt.S_CU_END] = n
    seq_ints[0, bt.S_KV_LEN] = n
    seq_ints[0, bt.S_LOGITS_ROW] = n - 1
    seq_ints[0, bt.SI] = 2
    out = runner.prefill(tok_ints, tok_floats, seq_ints, seq_floats, jnp.zeros((1, 728, 256), jnp.float32))
    results = [np.asarray(out)]
    prev = out
    for steps in (1, 2):
        ints, floats = bt.empty_decode(1, p)
        ints[0, bt.D_POS] = n
        ints[0, bt.D_SLOT] = 2 * runner.page_size + n
        ints[0, bt.D_KV_LEN] = n + 1
        ints[0, bt.D_NUM_VALID] = 1
        ints[0, bt.DI] = 2
        bt.decode_row(ints, floats, 0, kind=0, token=0, value=(0.0, 0.0), src=0, spec=bt.RowSpec(), steps=steps)
        outs, prev = runner.decode(ints, floats, prev, steps)
        results.append(np.asarray(outs))
        n += steps
    results.append(np.asarray(runner.cache.k[0]))
    return results


def test_second_runner_loads_the_exported_steps(model: MoondreamModel, plain: list[np.ndarray],
                                                exported: tuple[Path, list[np.ndarray]], tmp_path: Path) -> None:
    _, got = exported  # the first runner's outputs; it exported its three steps (the fixture checks)
    files = sorted((exported[0] / "kestrel_jax_export").glob("*.jaxexport"))
    assert len(files) == 3
    _from_exported(exported, tmp_path)
    second = Runner(model, _config(tmp_path))
    again = _run(second)
    assert second.export_counts == {"loaded": 3, "exported": 0, "fallback": 0}
    for a, b, c in zip(plain, got, again, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    # off: nothing written or read
    off = Runner(model, _config(tmp_path, export_steps=False))
    for a, b in zip(plain, _run(off), strict=True):
        np.testing.assert_array_equal(a, b)
    assert off.export_counts == {"loaded": 0, "exported": 0, "fallback": 0}


def test_a_damaged_export_falls_back_to_tracing(model: MoondreamModel, exported: tuple[Path, list[np.ndarray]],
                                                tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _from_exported(exported, tmp_path)
    plain = exported[1]
    for f in (tmp_path / "kestrel_jax_export").glob("*.jaxexport"):
        f.write_bytes(b"not an export")
    runner = Runner(model, _config(tmp_path))
    with caplog.at_level(logging.WARNING):
        got = _run(runner)
    assert runner.export_counts["fallback"] == 3 and "no export cache" in caplog.text
    for a, b in zip(plain, got, strict=True):
        np.testing.assert_array_equal(a, b)


def test_recompile_guard_sees_exported_steps(model: MoondreamModel, tmp_path: Path) -> None:
    from kestrel_jax.serving.runner import RecompileError

    runner = Runner(model, _config(tmp_path))
    _run(runner)
    runner.freeze()
    _run(runner)  # the same shapes: nothing new
    tok_ints, tok_floats, seq_ints, seq_floats = bt.empty_prefill(32, 2, runner.max_pages_per_seq)  # new bucket
    with pytest.raises(RecompileError):
        runner.prefill(tok_ints, tok_floats, seq_ints, seq_floats, jnp.zeros((1, 728, 256), jnp.float32))


def test_a_loaded_program_that_fails_to_run_falls_back(model: MoondreamModel,
                                                       exported: tuple[Path, list[np.ndarray]], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # The first call of a loaded export compiles it; if that raises (a backend refusing the saved
    # program), the step runs as a plain jit, inputs intact, same outputs.
    from kestrel_jax.serving import export_cache

    _from_exported(exported, tmp_path)
    plain = exported[1]
    real_jit = export_cache.jax.jit

    def broken_jit(fn, **kw):  # jit(exp.call) -> a function that fails like a refused compile
        if getattr(fn, "__name__", "") == "call":  # Exported.call
            def fail(*args, **kwargs):
                raise RuntimeError("refused")
            fail._cache_size = lambda: 0  # type: ignore[attr-defined]
            return fail
        return real_jit(fn, **kw)

    monkeypatch.setattr(export_cache.jax, "jit", broken_jit)
    runner = Runner(model, _config(tmp_path))
    got = _run(runner)
    monkeypatch.undo()
    assert runner.export_counts["loaded"] == 3 and runner.export_counts["fallback"] == 3
    for a, b in zip(plain, got, strict=True):
        np.testing.assert_array_equal(a, b)


def _exports(cache: Path) -> set[str]:
    return {f.name for f in (cache / "kestrel_jax_export").glob("*.jaxexport")}


def test_exports_are_shared_by_configurations_that_do_not_shape_the_steps(
        model: MoondreamModel, exported: tuple[Path, list[np.ndarray]], tmp_path: Path) -> None:
    # W2 A/B runs alternated vision buckets 1 and 2: each run deleted the other's exports and traced
    # every step again. Settings outside the text steps now share them; settings that shape the steps
    # keep their own files side by side.
    _from_exported(exported, tmp_path)
    first = _exports(tmp_path)
    other = Runner(model, _config(tmp_path, kv_memory_fraction=0.5, vision_buckets=(1, 2), vision_attention="xla"))
    _run(other)
    assert other.export_counts == {"loaded": 3, "exported": 0, "fallback": 0}
    paged = Runner(model, _config(tmp_path, backend="reference"))  # another kernel backend: its own programs
    _run(paged)
    assert paged.export_counts == {"loaded": 0, "exported": 3, "fallback": 0}
    assert len(_exports(tmp_path)) == 6 and first < _exports(tmp_path)  # side by side
    # a kernel switch read at trace time (the benchmarks' A/B runs) is part of the program too: on the
    # H100 an A/B of such a switch loaded the other side's exported steps and measured one program twice
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KESTREL_JAX_DECODE_QKV_KERNEL", "0")
        switched = Runner(model, _config(tmp_path))
        _run(switched)
    assert switched.export_counts == {"loaded": 0, "exported": 3, "fallback": 0}
    again = Runner(model, _config(tmp_path))  # the first configuration's files are still there
    _run(again)
    assert again.export_counts == {"loaded": 3, "exported": 0, "fallback": 0}


def test_exports_of_older_code_are_replaced(model: MoondreamModel, exported: tuple[Path, list[np.ndarray]],
                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kestrel_jax.serving import runner as runner_mod

    _from_exported(exported, tmp_path)
    first = _exports(tmp_path)
    monkeypatch.setattr(runner_mod, "source_hash", lambda: "edited sources")
    newer = Runner(model, _config(tmp_path))
    _run(newer)
    assert newer.export_counts == {"loaded": 0, "exported": 3, "fallback": 0}
    second = _exports(tmp_path)
    assert len(first) == len(second) == 3 and not first & second


def test_loading_an_export_makes_the_mosaic_gpu_runtime_findable(tmp_path: Path) -> None:
    """A process that only loads exports never imports the kernel modules, and a Mosaic GPU custom call
    finds its runtime through what importing jax.experimental.mosaic.gpu sets up (on the H100 the
    first loaded step failed to compile without it)."""
    import subprocess
    import sys

    script = (
        "import sys, jax.numpy as jnp\n"
        "from kestrel_jax.serving.export_cache import ExportedStep\n"
        "step = ExportedStep('f', lambda x: x * 2, directory=sys.argv[1], salt='s')\n"
        "out = step(jnp.arange(3.0))\n"
        "assert list(out) == [0.0, 2.0, 4.0], out\n"
        "print(step.counts['exported'], step.counts['loaded'], 'jax.experimental.mosaic.gpu' in sys.modules)\n"
    )
    runs = [subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                           check=True).stdout.split() for _ in range(2)]
    assert runs[0] == ["1", "0", "False"]  # exporting traces the function itself: nothing to load
    assert runs[1] == ["0", "1", "True"]


@pytest.mark.parametrize("cache", [False, True], ids=["jit", "export"])
def test_steps_compiled_ahead_on_threads_are_not_compiled_again(model: MoondreamModel, plain: list[np.ndarray],
                                                                 tmp_path: Path, cache: bool,
                                                                 backend_compiles: Callable[[], Any]) -> None:
    runner = Runner(model, _config(tmp_path if cache else None))
    p = runner.max_pages_per_seq
    images = jnp.zeros((1, 728, 256))
    variants: list[tuple[str, tuple[object, ...]]] = [("prefill", (*bt.empty_prefill(16, 2, p), images))]
    variants += [("decode", (*bt.empty_decode(1, p), None, steps)) for steps in (1, 2)]
    runner.compile_ahead(variants, threads=3)
    with backend_compiles() as compiles:
        got = _run(runner)
    assert compiles == []
    for a, b in zip(plain, got, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="unknown step kind"):
        runner.compile_ahead([("vision", ())], threads=1)
