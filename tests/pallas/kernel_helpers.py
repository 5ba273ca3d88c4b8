"""Helpers shared by the kernel tests: a fresh random generator per test (its seed printed, so a
failing draw can be replayed) and float32 views of any-dtype arrays for comparisons."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np


def fresh_rng() -> np.random.Generator:
    seed = int(time.time_ns() % 2**32)
    print(f"test seed = {seed}")
    return np.random.default_rng(seed)


def as_f32(x: jax.Array) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32))
