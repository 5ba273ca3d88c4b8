"""The Mosaic GPU lowering cache (`kestrel_jax/pallas/lowering_cache.py`), cross-lowered for an
abstract H100 on the CPU: a step lowered with kernels served from the cache is byte for byte the
step lowered afresh, distinct kernels get distinct entries, and a failing cached path lowers
afresh."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from kestrel_jax.models.config import md3_config
from kestrel_jax.models.moondream import abstract_model
from kestrel_jax.models.text import KVCache
from kestrel_jax.pallas import gemv_mgpu, lowering_cache
from kestrel_jax.serving import batch as bt
from kestrel_jax.serving.runner import _decode_step, _Parts

S = jax.ShapeDtypeStruct
H100 = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
MESH = AbstractMesh((1,), ("x",), (AxisType.Auto,), abstract_device=H100)


@pytest.fixture(autouse=True)
def fresh_cache() -> Iterator[None]:
    assert lowering_cache.install()  # importing the kernel modules installed it (idempotent)
    lowering_cache.clear()
    yield
    lowering_cache.clear()


def _lower(fn: Any, *specs: Any) -> str:
    with jax.sharding.use_abstract_mesh(MESH):
        return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


def _gemv_text(m: int, k: int, n: int, stages: int = 4) -> str:
    return _lower(functools.partial(gemv_mgpu.gemv, stages=stages), S((m, k), jnp.bfloat16), S((k, n), jnp.bfloat16))


def test_equal_kernels_share_one_lowering_and_distinct_ones_do_not() -> None:
    a = _gemv_text(1, 2048, 2048)
    assert "mosaic_gpu" in a
    assert lowering_cache.stats() == {"hits": 0, "misses": 1, "fallbacks": 0, "entries": 1}
    assert _gemv_text(1, 2048, 2048) == a  # the same step again: its kernel from the cache
    assert lowering_cache.stats()["hits"] == 1
    # twice the columns: another grid, another kernel, another entry
    b = _gemv_text(1, 2048, 4096)
    assert lowering_cache.stats()["misses"] == 2 and b != a
    # 8 rows: the kernel pads 1 row to 8 (its wgmma N), so the same kernel serves another program
    d = _gemv_text(8, 2048, 2048)
    assert lowering_cache.stats() == {"hits": 2, "misses": 2, "fallbacks": 0, "entries": 2}
    assert d != a
    lowering_cache.clear()
    assert _gemv_text(8, 2048, 2048) == d  # ... and that program is its fresh lowering


def _rows_kernel(programs: int) -> Any:
    """o[i] = x[i] + 1 for i < `programs` over a [4, 128] operand: the same jaxpr, operand and
    result shapes for any grid, so only the kernel mesh tells two grids apart."""
    def body(x_ref: Any, o_ref: Any) -> None:
        i = jax.lax.axis_index("g")
        o_ref[i] = x_ref[i] + 1.0

    return plgpu.kernel(body, out_type=S((4, 128), jnp.float32), grid=(programs,), grid_names=("g",))


def test_kernels_that_differ_only_in_their_grid_get_distinct_entries() -> None:
    a = _lower(_rows_kernel(2), S((4, 128), jnp.float32))
    b = _lower(_rows_kernel(4), S((4, 128), jnp.float32))
    assert lowering_cache.stats() == {"hits": 0, "misses": 2, "fallbacks": 0, "entries": 2}
    assert a != b
    lowering_cache.clear()
    assert _lower(_rows_kernel(4), S((4, 128), jnp.float32)) == b


def test_lowering_is_deterministic_without_the_cache_too() -> None:
    """Mosaic GPU's counter-named module attribute is normalised: two fresh lowerings of one kernel
    give the same bytes (and so the same kernel hash and the same persistent-cache key)."""
    a = _gemv_text(1, 2048, 2048)
    lowering_cache.clear()
    b = _gemv_text(1, 2048, 2048)
    assert lowering_cache.stats()["hits"] == 0
    assert a == b


def test_a_cached_module_that_does_not_parse_is_lowered_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    a = _gemv_text(1, 2048, 2048)

    def broken(data: bytes) -> Any:
        raise ValueError("no such dialect")

    monkeypatch.setattr(lowering_cache, "_parse", broken)
    assert _gemv_text(1, 2048, 2048) == a
    st = lowering_cache.stats()
    assert st["hits"] == 0 and st["fallbacks"] >= 1


def test_switch_off_leaves_jax_lowering_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    from jax._src.pallas.mosaic_gpu import lowering

    wrapped: Any = lowering.lower_unpipelined_jaxpr_to_module
    lowering_cache.uninstall()
    try:
        assert lowering.lower_unpipelined_jaxpr_to_module is wrapped.__wrapped__
        monkeypatch.setenv("KESTREL_JAX_LOWERING_CACHE", "0")
        assert not lowering_cache.install()
        _gemv_text(1, 2048, 2048)
        assert lowering_cache.stats()["misses"] == 0
    finally:
        monkeypatch.delenv("KESTREL_JAX_LOWERING_CACHE")
        assert lowering_cache.install()


def test_md3_decode_variants_of_one_bucket_share_their_kernels() -> None:
    """MD3 at full size (4 dense layers and one MoE layer: every decode kernel): the one-iteration
    step, then the 8-iteration text step from the kernels it cached; the text step equals its fresh
    lowering byte for byte."""
    cfg = md3_config()
    cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, n_layers=5)).validate()
    model = abstract_model(cfg, fp8_experts=True)
    text_gd, text_state = nnx.split(model.text)
    region_gd, region_state = nnx.split(model.region)
    leaves, treedef = jax.tree.flatten((text_state, region_state))
    params = [S(p.shape, p.dtype) for p in leaves]
    parts = _Parts(cfg, jnp.bfloat16, text_gd, region_gd, treedef)
    t = cfg.text
    kv = tuple(S((256, t.n_kv_heads, 64, t.head_dim), jnp.float8_e4m3fn) for _ in range(t.n_layers))
    scale = S((t.n_layers,), jnp.float32)
    cache = KVCache(kv, kv, scale, scale)  # type: ignore[arg-type]  # shapes only: lowered, never run
    ints, floats = bt.empty_decode(1, 16)
    specs = (params, cache, S(ints.shape, ints.dtype), S(floats.shape, floats.dtype), S((5, 6), jnp.float32))

    def step(steps: int, region: bool) -> str:
        return _lower(functools.partial(_decode_step, parts, backend="kernel", out_rows=5, steps=steps,
                                        region=region), *specs)

    step(1, True)
    one = lowering_cache.stats()
    shared = step(8, False)
    text = lowering_cache.stats()
    assert text["hits"] - one["hits"] >= 6  # the layers' kernels (attention, GEMVs, MoE, sampling)
    assert text["misses"] == one["misses"]  # the text step calls no kernel the full step does not
    lowering_cache.clear()
    assert step(8, False) == shared
