"""The `interpret` argument of this package's Mosaic GPU kernels: every kernel run in JAX's Mosaic
GPU interpreter (on the CPU: the tests, debugging) takes it from here, so that the interpreter runs
with the workaround below installed.

The workaround: JAX 0.11.2's interpreter runs each simulated GPU operation as an io_callback, which
receives its operands as jax.Arrays, and several of those callbacks compute on them with JAX
(`wait_smem_to_gmem` compares its count `n` with a Python int, `_deallocate_barrier` indexes its key
array, ...): JAX ops dispatched from inside a callback, some while holding the interpreter's lock.
When the calling thread dispatches JAX work of its own while the kernel runs (an un-jitted forward,
a runner's next step, a test's reference), the two can wait on each other forever. A model test
hung so in two CI runs of the fifty-fourth session's code (the stack, caught in the fifty-fifth: the
callback in `_operator_lt`, the main thread in an eager op); a CPU script that dispatches eager ops
while an interpreted decode GEMM runs, 40 times per run, hung in 3 of 20 runs without the
workaround and in none of 50 with it; the same around an interpreted MoE layer hung within 20
layers in each of 5 tries without it, and in none of 4 with it (`tests/pallas/test_mgpu_interpret.py`
checks the operands the callbacks get, and runs the MoE case). Installed, every io_callback whose
function is the interpreter's gets its jax.Array operands as NumPy arrays (top level and inside
tuples and lists): the same values, on which the callbacks' arithmetic and indexing are NumPy's,
dispatching nothing. Installed once per process, and only once a kernel is interpreted: compiled
kernels never see it."""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from kestrel_jax.pallas import lowering_cache

# one lowering per distinct kernel (lowering_cache.py); every kernel module imports this or l2_prefetch
lowering_cache.install()

_MARK = "kestrel_host_operands"
_INTERPRETER = "jax._src.pallas.mosaic_gpu.interpret."


def _host(value: Any) -> Any:
    if isinstance(value, jax.Array):
        return np.asarray(value)
    if isinstance(value, (tuple, list)) and any(isinstance(v, jax.Array) for v in value):
        return type(value)(np.asarray(v) if isinstance(v, jax.Array) else v for v in value)
    return value


def _function_of(cb: Any) -> Any:
    while isinstance(cb, functools.partial):
        cb = cb.func
    return cb


def is_interpreter_callback(cb: Any) -> bool:
    """Whether io_callback's function `cb` (or the function a partial wraps) is the interpreter's."""
    return getattr(_function_of(cb), "__module__", "").startswith(_INTERPRETER)


def _on_host_operands(cb: Any) -> Any:
    """`cb` called with its jax.Array operands as NumPy arrays."""
    def call(*args: Any, **kwargs: Any) -> Any:  # this module's: not taken for the interpreter's
        return cb(*(_host(a) for a in args), **{k: _host(v) for k, v in kwargs.items()})

    return call


# One wrapper per plain function, so that equal callbacks stay equal in JAX's caches (a partial is
# made anew for each call site, and wrapped anew).
_on_host_operands_of_function = functools.cache(_on_host_operands)


def install() -> None:
    """Installs the workaround (idempotent)."""
    from jax._src import callback

    original = callback.io_callback
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def io_callback(cb: Any, *args: Any, **kwargs: Any) -> Any:
        if is_interpreter_callback(cb):
            cb = _on_host_operands(cb) if isinstance(cb, functools.partial) else _on_host_operands_of_function(cb)
        return original(cb, *args, **kwargs)

    setattr(io_callback, _MARK, True)
    callback.io_callback = io_callback  # type: ignore[assignment]


def params(detect_races: bool = False, **kwargs: Any) -> Any:
    """`plgpu.InterpretGPUParams(detect_races=..., **kwargs)`, with the workaround installed."""
    install()
    return plgpu.InterpretGPUParams(detect_races=detect_races, **kwargs)


def resolve(interpret: object) -> Any:
    """A kernel's `interpret` argument as `plgpu.kernel` takes it: None (or False) compiled, True
    the interpreter's defaults, interpreter parameters as given; the workaround installed for the
    last two."""
    if interpret is None or interpret is False:
        return None
    if interpret is True:
        return params()
    install()
    return interpret
