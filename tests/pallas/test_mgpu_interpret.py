"""kestrel_jax/pallas/mgpu_interpret.py: every Mosaic GPU kernel interpreted here runs with the
workaround that hands JAX 0.11.2's interpreter callbacks NumPy operands, so that they dispatch no
JAX op from inside a callback (a deadlock against the calling thread's own dispatches)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import callback
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
from jax.experimental.pallas import mosaic_gpu as plgpu

from kestrel_jax.pallas import gemv_mgpu, mgpu_interpret

REPO = Path(__file__).resolve().parents[2]

# Two of the callbacks that computed on jax.Array operands in hung runs: `wait_smem_to_gmem`
# (`len(...) > n`) and `_deallocate_barrier` (indexing its key array).
_WATCHED = ("wait_smem_to_gmem", "_deallocate_barrier")


def _operand_types(monkeypatch: pytest.MonkeyPatch) -> dict[str, set[type]]:
    """Runs an interpreted decode GEMM through the package's own `interpret=True` path; the types of
    the operands that reached the watched interpreter callbacks."""
    seen: dict[str, set[type]] = {name: set() for name in _WATCHED}
    for name in _WATCHED:
        original = getattr(gpu_callbacks, name)

        @functools.wraps(original)  # the interpreter's module name too: taken for its callback
        def recorder(*args, _name=name, _original=original, **kwargs):  # noqa: ANN001, ANN202
            seen[_name].update(type(v) for v in (*args, *kwargs.values()))
            return _original(*args, **kwargs)

        monkeypatch.setattr(gpu_callbacks, name, recorder)
    jax.clear_caches()  # the callbacks are bound when the kernel is traced
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((128, 64)), jnp.bfloat16)
    got = gemv_mgpu.gemv_partials(x, w, splits=2, stages=1, interpret=True)
    want = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    np.testing.assert_allclose(np.asarray(got).sum(0)[:, 0], want[0], rtol=1e-5, atol=1e-4)
    jax.clear_caches()  # no trace bound to the recorders outlives the test
    assert all(seen.values()), seen  # each watched callback ran
    return seen


def _has_jax_arrays(types: set[type]) -> bool:
    return any(issubclass(t, jax.Array) for t in types)


def test_interpreter_callbacks_get_numpy_operands(monkeypatch: pytest.MonkeyPatch) -> None:
    mgpu_interpret.install()
    seen = _operand_types(monkeypatch)
    assert not any(_has_jax_arrays(types) for types in seen.values()), seen
    assert all(np.ndarray in types for types in seen.values()), seen


def test_without_the_workaround_they_get_jax_arrays(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the workaround is for, on this JAX: if this fails, the interpreter's callbacks get plain
    values from JAX itself and the workaround can go."""
    mgpu_interpret.install()
    monkeypatch.setattr(callback, "io_callback", callback.io_callback.__wrapped__)  # type: ignore[attr-defined]
    monkeypatch.setattr(mgpu_interpret, "install", lambda: None)  # keep JAX's own for this run
    seen = _operand_types(monkeypatch)
    assert all(_has_jax_arrays(types) for types in seen.values()), seen


def test_install_is_idempotent_and_resolve_maps_the_argument() -> None:
    mgpu_interpret.install()
    installed = callback.io_callback
    mgpu_interpret.install()
    assert callback.io_callback is installed
    assert mgpu_interpret.is_interpreter_callback(functools.partial(gpu_callbacks.wait_smem_to_gmem, n=0))
    assert not mgpu_interpret.is_interpreter_callback(print)
    assert mgpu_interpret.resolve(None) is None and mgpu_interpret.resolve(False) is None
    assert isinstance(mgpu_interpret.resolve(True), plgpu.InterpretGPUParams)
    given = plgpu.InterpretGPUParams(detect_races=True)
    assert mgpu_interpret.resolve(given) is given
    assert mgpu_interpret.params(detect_races=True).detect_races


def test_interpreted_moe_beside_eager_dispatch_finishes() -> None:
    """The deadlock itself, in a process of its own (a hang fails this test after 150 s rather than
    stopping the suite): ten interpreted MoE layers, each with eager ops dispatched while it runs.
    Without the workaround the same script hung within 20 layers in each of 3 tries."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("interpret_deadlock_run.py")), "--runs", "10"],
                         capture_output=True, text=True, env=env, timeout=150)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), (run.returncode, run.stdout, run.stderr[-3000:])
