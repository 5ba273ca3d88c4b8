"""Page copies run over the smallest compiled row bucket that holds the plan's real copies, and
copy exactly those pages (every layer, K and V); padding rows (-1) copy nothing."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from kestrel_jax.models.config import tiny_config
from kestrel_jax.models.moondream import random_model
from kestrel_jax.serving.runner import COPY_BUCKETS, Runner, RunnerConfig


@pytest.fixture(scope="module")
def runner() -> Runner:
    model = random_model(tiny_config("md3", vision_layers=2), dtype=jnp.float32)
    return Runner(model, RunnerConfig(num_pages=24, kv_dtype="f32", max_seq_len=256, page_size=64,
                                      vision_buckets=(2,)), out_rows=4)


def _fill(runner: Runner, rng: np.random.Generator) -> list[np.ndarray]:
    k = [jnp.asarray(rng.standard_normal(a.shape), a.dtype) for a in runner.cache.k]
    v = [jnp.asarray(rng.standard_normal(a.shape), a.dtype) for a in runner.cache.v]
    runner.cache = runner.cache._replace(k=tuple(k), v=tuple(v))
    return [np.asarray(a) for a in (*k, *v)]


@pytest.mark.parametrize("num", [1, 3, 5, 20])
def test_copies_use_the_smallest_bucket_and_copy_exactly_the_real_rows(runner: Runner, num: int) -> None:
    rng = np.random.default_rng(num)
    max_copies = 20
    plan = np.full((max_copies, 2), -1, np.int32)
    pages = rng.permutation(runner.num_pages)
    plan[:num, 0], plan[:num, 1] = pages[:num], pages[num: 2 * num] if 2 * num <= runner.num_pages else 0
    if 2 * num > runner.num_pages:  # 20 copies: sources and destinations overlap-free by construction
        plan[:num, 0], plan[:num, 1] = np.arange(num) % 2, np.arange(2, 2 + num)
    before = _fill(runner, rng)
    sizes: list[int] = []
    orig = runner._guarded

    def spy(name, fn, *args):  # the copies array the step was given
        if name == "copy":
            sizes.append(args[1].shape[0])
        return orig(name, fn, *args)

    runner._guarded = spy  # type: ignore[method-assign]
    try:
        runner.copy_pages(plan, num)
    finally:
        del runner._guarded
    want_rows = next((b for b in COPY_BUCKETS if num <= b < max_copies), max_copies)
    assert sizes == [want_rows] and want_rows in runner.copy_buckets(max_copies)
    after = [np.asarray(a) for a in (*runner.cache.k, *runner.cache.v)]
    for b, a in zip(before, after, strict=True):
        want = b.copy()
        want[plan[:num, 1]] = b[plan[:num, 0]]
        np.testing.assert_array_equal(a, want)


def test_copy_buckets_end_with_the_plan_size() -> None:
    assert Runner.copy_buckets(72) == (*COPY_BUCKETS, 72)
    assert Runner.copy_buckets(3) == (1, 3)
    assert Runner.copy_buckets(1) == (1,)


class _FakeDevice:
    def __init__(self, limit: int, in_use: int):
        self.stats = {"bytes_limit": limit, "bytes_in_use": in_use}

    def memory_stats(self) -> dict[str, int]:
        return self.stats


def test_pool_size_from_memory_is_stable_and_quantised(runner: Runner, monkeypatch: pytest.MonkeyPatch) -> None:
    # The pool's page count is part of every compiled step: sized from the memory the params leave
    # (not from momentary free memory) and rounded to PAGE_QUANTUM pages, the same count comes out
    # when a few pages' worth of other allocations come and go, so a restart hits the compile cache.
    from kestrel_jax.serving import runner as runner_mod

    page = runner.kv_bytes_per_page()
    params = sum(int(a.nbytes) for a in (*runner.lm_params, *runner.vision_params))
    limit = params + 1000 * page
    counts = set()
    for jitter in (0, 1, 3, 7):
        monkeypatch.setattr(runner, "device", _FakeDevice(limit, params + jitter * page))
        counts.add(runner._pages_from_memory())
    monkeypatch.undo()
    assert counts == {int(1000 * runner.config.kv_memory_fraction) // runner_mod.PAGE_QUANTUM * runner_mod.PAGE_QUANTUM}
    # something else holding most of the memory: the pool shrinks to what is really free
    monkeypatch.setattr(runner, "device", _FakeDevice(limit, params + 700 * page))
    n = runner._pages_from_memory()
    monkeypatch.undo()
    assert n * page <= 300 * page * runner.config.kv_memory_fraction and n % runner_mod.PAGE_QUANTUM == 0


def test_pool_size_ignores_memory_held_by_unreachable_objects(runner: Runner, monkeypatch: pytest.MonkeyPatch) -> None:
    # Random weights made on the device left temporaries whose release depended on the garbage
    # collector's timing, and two processes sized 5056 vs 4800 pages (tenth session): the sizing
    # collects garbage before it reads the memory statistics.
    import gc
    import weakref

    from kestrel_jax.serving import runner as runner_mod

    class Garbage:  # a reference cycle: only the cycle collector frees it
        def __init__(self) -> None:
            self.me = self

    page = runner.kv_bytes_per_page()
    params = sum(int(a.nbytes) for a in (*runner.lm_params, *runner.vision_params))
    limit = params + 1000 * page
    held = Garbage()
    alive = weakref.ref(held)
    del held

    class Device:
        def memory_stats(self) -> dict[str, int]:  # 600 pages in use while the garbage lives
            return {"bytes_limit": limit, "bytes_in_use": params + (600 * page if alive() is not None else 0)}

    gc.disable()  # no automatic collection between here and the sizing
    try:
        assert alive() is not None
        monkeypatch.setattr(runner, "device", Device())
        n = runner._pages_from_memory()
    finally:
        gc.enable()
        monkeypatch.undo()
    assert alive() is None
    assert n == int(1000 * runner.config.kv_memory_fraction) // runner_mod.PAGE_QUANTUM * runner_mod.PAGE_QUANTUM


def test_runners_keep_their_own_step_caches(runner: Runner) -> None:
    """Two runners (one per device in a multi-device engine) must not share a jitted step's cache:
    `freeze` counts each step's variants there, and the other runner's compiles would read as a
    recompile while serving. A copy step compiled by a second runner leaves the first's count alone."""
    other = Runner(runner.model, dataclasses.replace(runner.config), out_rows=runner.out_rows)
    before = {name: fn._cache_size() for name, fn in runner._fns().items() if name in ("copy", "crops")}
    other.copy_pages(np.zeros((1, 2), np.int32))
    assert other._fns()["copy"]._cache_size() == 1
    assert {name: fn._cache_size() for name, fn in runner._fns().items() if name in ("copy", "crops")} == before


class _VmmDevice:
    """A GPU whose allocator keeps no statistics (XLA's VMM allocator, taken with SKIP_TEMP)."""
    platform = "gpu"

    def memory_stats(self) -> None:
        return None


def _vmm_sizing(runner: Runner, monkeypatch: pytest.MonkeyPatch, free: int, total: int, live: int,
                fraction: str | None = None) -> int:
    from kestrel_jax.serving import runner as runner_mod

    monkeypatch.setattr(runner, "device", _VmmDevice())
    monkeypatch.setattr(runner_mod, "gpu_memory_info", lambda dev: (free, total))
    monkeypatch.setattr(runner_mod, "live_bytes", lambda dev: live)
    if fraction is None:
        monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    else:
        monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", fraction)
    try:
        return runner._pages_from_memory()
    finally:
        monkeypatch.undo()


def test_pool_size_without_allocator_statistics_matches_the_bfc_sizing(runner: Runner,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # The same device and params give the same pool whichever allocator the client took: the budget
    # is the client's memory fraction (0.75 unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise) of
    # the device, what is in use the live arrays, and memory the driver counts as used beyond them
    # (the VMM allocator keeps freed memory mapped) does not shrink the pool.
    from kestrel_jax.serving import runner as runner_mod

    page = runner.kv_bytes_per_page()
    params = sum(int(a.nbytes) for a in (*runner.lm_params, *runner.vision_params))
    total = 4000 * page
    limit = int(total * 0.75)
    monkeypatch.setattr(runner, "device", _FakeDevice(limit, params))
    bfc = runner._pages_from_memory()
    monkeypatch.undo()
    assert bfc % runner_mod.PAGE_QUANTUM == 0 and bfc > 0
    for used_by_driver in (params, params + 700 * page, params + 1500 * page):
        assert _vmm_sizing(runner, monkeypatch, free=total - used_by_driver, total=total, live=params) == bfc
    # the client's fraction is honoured
    half = _vmm_sizing(runner, monkeypatch, free=total - params, total=total, live=params, fraction="0.5")
    monkeypatch.setattr(runner, "device", _FakeDevice(int(total * 0.5), params))
    assert half == runner._pages_from_memory() < bfc
    monkeypatch.undo()
    # live arrays beyond the params (another model in this process) shrink it as bytes_in_use does
    monkeypatch.setattr(runner, "device", _FakeDevice(limit, params + 1200 * page))
    shrunk = runner._pages_from_memory()
    monkeypatch.undo()
    assert shrunk < bfc
    assert _vmm_sizing(runner, monkeypatch, free=total - params - 1200 * page, total=total,
                       live=params + 1200 * page) == shrunk


def test_pool_size_without_statistics_fits_what_the_driver_has_free(runner: Runner,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # Other processes on the device hold most of it: the pool takes the configured fraction of what
    # is free instead of failing its allocation later.
    from kestrel_jax.serving import runner as runner_mod

    page = runner.kv_bytes_per_page()
    params = sum(int(a.nbytes) for a in (*runner.lm_params, *runner.vision_params))
    n = _vmm_sizing(runner, monkeypatch, free=1000 * page, total=8000 * page, live=params)
    assert n == int(1000 * page * runner.config.kv_memory_fraction) // page // runner_mod.PAGE_QUANTUM \
        * runner_mod.PAGE_QUANTUM
    assert n * page <= 1000 * page


def test_pool_size_without_any_memory_figures_takes_the_floor(runner: Runner, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    from kestrel_jax.serving import runner as runner_mod

    monkeypatch.setattr(runner, "device", _VmmDevice())
    monkeypatch.setattr(runner_mod, "gpu_memory_info", lambda dev: None)
    with caplog.at_level("WARNING", logger=runner_mod.__name__):
        n = runner._pages_from_memory()
    monkeypatch.undo()
    assert n == runner.max_pages_per_seq * 8
    assert "RunnerConfig.num_pages" in caplog.text


def test_gpu_memory_info_is_none_off_cuda() -> None:
    import gc

    import jax

    from kestrel_jax.serving.runner import gpu_memory_info, live_bytes

    dev = jax.devices()[0]
    assert gpu_memory_info(dev) is None  # the CPU test platform
    gc.collect()
    gc.disable()  # no array freed by a collection between the two readings
    try:
        before = live_bytes(dev)
        y = jnp.ones((2000,), jnp.float32)
        after = live_bytes(dev)
    finally:
        gc.enable()
    assert after - before == 8000
    del y
