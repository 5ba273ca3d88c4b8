"""Run as a script by tests/pallas/test_mgpu_interpret.py: an interpreted MoE layer (test_moe's
small FP8 case), `--runs` times, each time with 300 eager JAX ops dispatched while it runs, every
output checked against the first. Without the workaround of kestrel_jax/pallas/mgpu_interpret.py
(`--without-workaround`, for showing what the test guards against) JAX 0.11.2's interpreter
deadlocked within 20 runs in each of 3 tries and within 10 in each of 2; with it, none of 4 tries
did. Prints "ok" at the end."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--without-workaround", action="store_true")
    a = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kestrel_jax.pallas import mgpu_interpret

    if a.without_workaround:
        mgpu_interpret.install = lambda: None
    import test_moe as tm  # builds its interpreter parameters through mgpu_interpret

    from kestrel_jax.pallas.moe_mgpu import moe

    rng = np.random.default_rng(0)
    T = 5
    ex = tm.make_experts(rng, fp8=True)
    x = jnp.asarray(rng.standard_normal((T, tm.D_FP8)), jnp.bfloat16)
    routing = tm.random_routing(rng, T, tm.E)
    cfg = tm.small_config(T)
    layer = jax.jit(lambda x, r, e: moe(x, r, e, config=cfg, interpret=tm.INTERPRET))
    first = np.asarray(layer(x, routing, ex))
    y = jnp.ones((64, 64))
    for run in range(a.runs):
        out = layer(x, routing, ex)
        z = y
        for _ in range(300):  # eager ops while the interpreted kernel runs
            z = z * 1.0001
        assert np.array_equal(np.asarray(out), first, equal_nan=True), run
    print("ok")


if __name__ == "__main__":
    main()
