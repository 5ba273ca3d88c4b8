"""One Mosaic GPU lowering per distinct kernel in a process, shared by every step that calls it.

JAX lowers a Pallas Mosaic GPU kernel (its layout inference, then the Mosaic dialect's lowering,
all Python) each time a jitted step containing it is lowered. `ops._jitted` already shares one
lowering among a step's layers; across steps there was none: an engine's start-up lowers tens of
decode, prefill and mixed variants, and the variants of one batch bucket (one-iteration,
multi-step, the text step) call the same kernels on the same shapes. Cross-lowered for an H100 on
a 2-core CPU (session 60), MD3's batch-1 8-iteration text step spends 10.9 of its 12 s of lowering
in its 9 Mosaic kernels; on the GPU machine the lowering of MD3's 38 default step variants summed
1,216 s over the start-up's compile threads. With this cache, cross-lowered on the CPU, those 38
steps lower in 94.8 s instead of 155.9 (their decode steps' 150 kernel lowerings are 47 distinct
kernels), each HLO byte-identical (BENCHMARKS.md, sixtieth session). On an H100 (sixty-first
session, another machine than the figure before it) MD3's cold start with the default buckets took
256.6 s with the cache against 277.7 s without, the lowering summed over the threads 938 s
against 1,216.

Also, Mosaic GPU names each lowered module after a process-wide counter (the
`mosaic_gpu.dump_basename` attribute, used only to name debug dump files). The counter made the
module bytes, and so the custom call's `kernel_hash` and the step's HLO, differ between two
lowerings of the same kernel: in another variant, in another process, or in another order of the
compile threads. The attribute is set here to the kernel's own name, so equal kernels lower to
equal bytes.

`install()` wraps `lower_unpipelined_jaxpr_to_module`, the lowering that Pallas' Mosaic GPU
`pallas_call` / `plgpu.kernel` rule calls, with a cache keyed by a SHA-256 of everything that
function reads (the kernel's jaxpr as printed, the kernel mesh, the JAX mesh, operand and result
shapes, compiler parameters). A hit parses the cached module's bytecode into the lowering's MLIR
context: the step's HLO is byte-for-byte the one a fresh lowering gives (tested on the production
shapes, `tests/pallas/test_lowering_cache.py`). Anything unexpected in the cached path falls back
to lowering afresh. `KESTREL_JAX_LOWERING_CACHE=0` leaves JAX as it is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import threading
from typing import Any

from kestrel_jax.switches import flag

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
_CACHE: dict[bytes, tuple[bytes, Any]] = {}
_STATS = {"hits": 0, "misses": 0, "fallbacks": 0}
_INSTALLED: list[Any] = []  # [the wrapped function] once installed
BASENAME = "mosaic_gpu.dump_basename"


def _key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params = args
    parts = (str(jaxpr), repr(mesh), repr(jax_mesh), repr(tuple(in_shapes)), repr(tuple(out_shapes)),
             repr(params), repr(sorted((k, v) for k, v in kwargs.items() if k != "outer_traceback")))
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\x00")
    return h.digest()


def _normalize(module: Any) -> None:
    """The counter-named dump basename -> the module's own symbol name (same kernel, same bytes)."""
    from jax._src.lib.mlir import ir

    attrs = module.operation.attributes
    if BASENAME in attrs:
        name = attrs["sym_name"].value if "sym_name" in attrs else "mosaic_gpu_kernel"
        attrs[BASENAME] = ir.StringAttr.get(name)


def _bytecode(module: Any) -> bytes:
    buf = io.BytesIO()
    module.operation.write_bytecode(buf)
    return buf.getvalue()


def _parse(data: bytes) -> Any:
    """A cached module's bytecode -> a module in the lowering's (current) MLIR context."""
    from jax._src.lib.mlir import ir

    return ir.Module.parse(data)


def _wrap(lower: Any) -> Any:
    def cached_lower(*args: Any, **kwargs: Any) -> Any:
        try:
            key = _key(args, kwargs)
        except Exception:  # noqa: BLE001 - an argument we cannot print: lower as JAX would
            _STATS["fallbacks"] += 1
            return lower(*args, **kwargs)
        hit = _CACHE.get(key)
        if hit is not None:
            data, result = hit
            try:
                module = _parse(data)
            except Exception as e:  # noqa: BLE001 - e.g. a dialect this context lacks
                log.warning("cached Mosaic GPU module did not parse (%s); lowering it again", e)
                _STATS["fallbacks"] += 1
            else:
                _STATS["hits"] += 1
                return dataclasses.replace(result, module=module)
        result = lower(*args, **kwargs)
        _normalize(result.module)
        with _LOCK:
            _STATS["misses"] += 1
            _CACHE[key] = (_bytecode(result.module), dataclasses.replace(result, module=None))
        return result

    cached_lower.__wrapped__ = lower  # type: ignore[attr-defined]
    return cached_lower


def install() -> bool:
    """Wrap JAX's Mosaic GPU kernel lowering with the cache (once per process; idempotent).
    Returns whether the cache is on."""
    if _INSTALLED:
        return True
    if not flag("KESTREL_JAX_LOWERING_CACHE", True):
        return False
    try:
        from jax._src.pallas.mosaic_gpu import lowering
    except Exception as e:  # noqa: BLE001 - no Mosaic GPU in this jaxlib: nothing to cache
        log.debug("Mosaic GPU lowering not importable (%s): no lowering cache", e)
        return False
    fn = getattr(lowering, "lower_unpipelined_jaxpr_to_module", None)
    if fn is None or not dataclasses.is_dataclass(getattr(lowering, "LoweringResult", None)):
        log.warning("this JAX has no lower_unpipelined_jaxpr_to_module / LoweringResult: no lowering cache")
        return False
    lowering.lower_unpipelined_jaxpr_to_module = _wrap(fn)
    _INSTALLED.append(fn)
    return True


def uninstall() -> None:
    """Restore JAX's own lowering (tests)."""
    if _INSTALLED:
        from jax._src.pallas.mosaic_gpu import lowering

        lowering.lower_unpipelined_jaxpr_to_module = _INSTALLED.pop()


def clear() -> None:
    with _LOCK:
        _CACHE.clear()
        for k in _STATS:
            _STATS[k] = 0


def stats() -> dict[str, int]:
    """Lowerings served from the cache (hits), done and cached (misses), and done without it."""
    return {**_STATS, "entries": len(_CACHE)}
