"""Lowered steps kept on disk (`jax.export`), so that a restart skips tracing and lowering.

A warm start-up with the persistent compilation cache still traces every step variant and lowers
it to StableHLO before the cache can be asked: for MD3 that was ~32 s of a 48 s start-up (18 step
variants, each 24 layers of Pallas kernels whose lowering runs in Python). `ExportedStep` wraps a
step function like `jax.jit` does; the first call of each input-shape variant either loads that
variant's serialized export from `directory` or exports and saves it, and from then on calls
`jax.jit(exported.call)`: tracing that is one call, and lowering embeds the saved module. XLA's
own cache then supplies the compiled program.

An export file is named by hashes of everything that shapes the program: the caller's `version`
(this package's source files and the jax version), its `salt` (model and the configuration that
shapes the steps, device kind), then the step's name, input tree and input avals. Writing a step's
export removes that step's files of other versions (older code), so the directory does not grow
across upgrades; files of other salts stay, so processes of different configurations (or
alternating runs) sharing one cache directory do not evict each other.
Any failure to export, save, load or compile the loaded program falls back to the plain jitted
function (logged once per step): slower start-up, same results.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from jax import export

log = logging.getLogger(__name__)

# Custom calls in our steps that jax.export does not list as stable across jax versions. The file
# names carry the jax version, so an export is only ever read back by the version that wrote it.
_UNSTABLE_CALLS = ("__gpu$xla.gpu.triton", "__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxDropout")


@functools.cache
def source_hash() -> str:
    """SHA-256 over this package's Python sources (a code change invalidates every export)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


@functools.cache
def _load_kernel_runtimes() -> None:
    """Make the Mosaic GPU runtime findable before a loaded program is compiled or read from cache.

    A Mosaic GPU custom call resolves its host symbols through MOSAIC_GPU_RUNTIME_LIB_PATH, which is
    set when jax.experimental.mosaic.gpu is imported. A process that only deserializes exports never
    traces a kernel, so nothing imports it: on the H100 the first loaded step failed with "Symbols not
    found: mosaic_gpu_init_tma_desc" and was compiled again from scratch (77 s).
    """
    with contextlib.suppress(ImportError):  # a jaxlib without Mosaic GPU: no such calls to run
        import jax.experimental.mosaic.gpu  # noqa: F401


def _avals_key(args: tuple[Any, ...]) -> str:
    leaves, tree = jax.tree.flatten(args)
    h = hashlib.sha256(str(tree).encode())
    for x in leaves:
        aval = jax.typeof(x) if isinstance(x, jax.Array) else jax.ShapeDtypeStruct(x.shape, x.dtype)
        h.update(f"{aval.shape}{aval.dtype}{getattr(aval, 'weak_type', False)};".encode())
    return h.hexdigest()[:32]


def _quick_sig(args: tuple[Any, ...]) -> tuple[Any, ...]:
    # Per call: only the top-level arrays' shapes and dtypes (the step inputs that change with the
    # bucket); params lists and the KV pool have one shape per runner.
    return tuple((x.shape, x.dtype) if hasattr(x, "shape") else type(x) for x in args)


class ExportedStep:
    def __init__(self, name: str, fn: Callable[..., Any], *, donate_argnums: tuple[int, ...] = (),
                 directory: str | os.PathLike[str] | None = None, salt: str = "", version: str = ""):
        self.name = name
        self.jitted = jax.jit(fn, donate_argnums=donate_argnums)
        self.donate_argnums = donate_argnums
        self.directory = Path(directory) if directory is not None else None
        self.salt = salt
        self.version = version
        self.counts = {"loaded": 0, "exported": 0, "fallback": 0}
        self._variants: dict[tuple[Any, ...], Any] = {}
        self._warned = False

    def __call__(self, *args: Any) -> Any:
        sig = _quick_sig(args)
        fn = self._variants.get(sig)
        if fn is not None:
            return fn(*args)
        fn = self._variants[sig] = self._variant(args)
        if fn is self.jitted:
            return fn(*args)
        try:  # the first call compiles the loaded program: a failure there leaves the inputs intact
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - the plain step instead, same results
            self._fallback(e)
            self._variants[sig] = self.jitted
            return self.jitted(*args)

    def compile_ahead(self, *args: Any) -> None:
        """Make and compile the variant for these inputs without running it (nothing is donated);
        a later call with inputs of the same shapes finds it compiled. Thread-safe across variants:
        the engine compiles several at once."""
        sig = _quick_sig(args)
        fn = self._variants.get(sig)
        if fn is None:
            fn = self._variants[sig] = self._variant(args)
        try:
            fn.lower(*args).compile()
        except Exception as e:  # noqa: BLE001 - a loaded program refused: the plain step, as in __call__
            if fn is self.jitted:
                raise
            self._fallback(e)
            self._variants[sig] = self.jitted
            self.jitted.lower(*args).compile()

    def _fallback(self, e: Exception) -> None:
        self.counts["fallback"] += 1
        if not self._warned:
            log.warning("step %s: no export cache (%s: %s); it is traced and lowered at every start-up",
                        self.name, type(e).__name__, e)
            self._warned = True

    def _cache_size(self) -> int:
        """Compiled variants so far (the runner's recompile guard compares this)."""
        return sum(f._cache_size() for f in {id(f): f for f in self._variants.values()}.values())

    def _variant(self, args: tuple[Any, ...]) -> Any:
        if self.directory is None:
            return self.jitted
        try:
            version = hashlib.sha256(self.version.encode()).hexdigest()[:12]
            salt = hashlib.sha256(self.salt.encode()).hexdigest()[:16]
            key = hashlib.sha256(f"{self.name}|{_avals_key(args)}".encode()).hexdigest()[:24]
            path = self.directory / f"{version}-{salt}-{self.name}-{key}.jaxexport"
            if path.is_file():
                _load_kernel_runtimes()
                exp = export.deserialize(bytearray(path.read_bytes()))
                self.counts["loaded"] += 1
            else:
                checks = [export.DisabledSafetyCheck.custom_call(t) for t in _UNSTABLE_CALLS]
                exp = export.export(self.jitted, disabled_checks=checks)(*args)
                self.directory.mkdir(parents=True, exist_ok=True)
                with tempfile.NamedTemporaryFile(dir=self.directory, delete=False) as f:
                    f.write(exp.serialize())
                os.replace(f.name, path)  # atomic: a concurrent reader never sees half a file
                self.counts["exported"] += 1
                for old in self.directory.glob(f"*-{self.name}-*.jaxexport"):  # older code
                    if not old.name.startswith(f"{version}-"):
                        old.unlink(missing_ok=True)
            return jax.jit(exp.call, donate_argnums=self.donate_argnums)
        except Exception as e:  # noqa: BLE001 - any failure: the plain jitted step, same results
            self._fallback(e)
            return self.jitted
