"""The `backend_compiles` fixture sees compiles and loads from the run's shared compilation cache
(tests/conftest.py): a recompile that hits the cache must not pass for "nothing compiled"."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def test_the_shared_cache_is_on_and_its_loads_count_as_compiles(backend_compiles: Callable[[], Any]) -> None:
    assert jax.config.jax_compilation_cache_dir, "the suite's shared compilation cache is off"
    c = float(np.random.default_rng().integers(1, 1 << 20))  # a program no earlier run has cached

    def make() -> Callable[[jax.Array], jax.Array]:
        return jax.jit(lambda x: jnp.sin(x) * c + 1.0)  # a new function object each time: no jit hit

    x = jnp.arange(8, dtype=jnp.float32)
    with backend_compiles() as first:
        a = make()(x)
    assert any("backend_compile" in e for e in first), first
    with backend_compiles() as second:
        b = make()(x)  # the same program again: loaded from the persistent cache, not compiled
    assert "/jax/compilation_cache/cache_retrieval_time_sec" in second, second  # a load, not a compile
    np.testing.assert_array_equal(a, b)
    seen = len(first) + len(second)
    jax.jit(lambda x: jnp.cos(x) * c)(x)  # compiled after both blocks: their listeners are gone
    assert len(first) + len(second) == seen, (first, second)
