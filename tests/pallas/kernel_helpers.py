"""Helpers shared by the kernel tests: a fresh random generator per test (its seed printed, so a
failing draw can be replayed) and float32 views of any-dtype arrays for comparisons."""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np


def fresh_rng() -> np.random.Generator:
    """A generator on a fresh seed, printed; KESTREL_TEST_SEED=<seed> replays a printed one."""
    forced = os.environ.get("KESTREL_TEST_SEED")
    seed = int(forced) if forced else int(time.time_ns() % 2**32)
    print(f"test seed = {seed}")
    return np.random.default_rng(seed)


def as_f32(x: jax.Array) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32))
