#!/usr/bin/env python3
"""Run a few MoE layer calls (FP8 experts at MD3's production size) for an external profiler.

    ncu -k regex:mosaic_gpu_kernel --section SpeedOfLight --section ComputeWorkloadAnalysis \\
        python3 tools/profile_moe.py 1480 1480:block_tokens=64

Each case is a token count T with optional `MoEKernelConfig` overrides after it (`key=value`,
integers or 0/1 for flags), run through `moe_layer` `--calls` times on one set of random inputs
(64 experts, D 2048, I 1024, top-8, random router). It prints nothing of its own timing: use
tools/bench_moe.py for times.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: the bench's input builders

from bench_moe import Dims, make_experts  # noqa: E402

from kestrel_jax.pallas.moe_mgpu import MoEKernelConfig, default_config, moe_layer  # noqa: E402


def case_config(spec: str, num_ctas: int | None = None) -> tuple[int, MoEKernelConfig]:
    """"T[:key=value...]" -> (T, default_config(T) with the overrides)."""
    head, *parts = spec.split(":")
    T = int(head)
    cfg = default_config(T, num_ctas=num_ctas)
    fields = {f.name for f in dataclasses.fields(MoEKernelConfig)}
    over: dict[str, object] = {}
    for kv in parts:
        key, value = kv.split("=", 1)
        if key not in fields:
            raise SystemExit(f"unknown MoEKernelConfig field {key!r} in {spec!r}")
        current = getattr(cfg, key)
        over[key] = bool(int(value)) if isinstance(current, bool) else (int(value) if isinstance(current, int)
                                                                         else value)
    return T, dataclasses.replace(cfg, **over)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="+", help="T[:field=value...], e.g. 1480:block_tokens=64")
    ap.add_argument("--calls", type=int, default=1)
    ap.add_argument("--small", action="store_true", help="D 256, I 128, 8 experts, top-4, interpreted (CPU)")
    a = ap.parse_args(argv)
    key = jax.random.key(0)
    dims, interpret = Dims(), None  # MD3: 64 experts, D 2048, I 1024, top-8
    if a.small:
        from kestrel_jax.pallas import mgpu_interpret

        dims, interpret = Dims(E=8, D=256, I=128, k=4), mgpu_interpret.params()
    ex = make_experts(jax.random.fold_in(key, 1), dims, True)
    rw = jax.random.normal(jax.random.fold_in(key, 2), (dims.D, dims.E), jnp.float32) / math.sqrt(dims.D)
    rw = rw.astype(jnp.bfloat16)
    rb = jnp.zeros((dims.E,), jnp.bfloat16)
    for spec in a.cases:
        T, cfg = case_config(spec, num_ctas=3 if a.small else None)
        if a.small:
            cfg = dataclasses.replace(cfg, max_stages=3)
        x = jax.random.normal(jax.random.fold_in(key, T), (T, dims.D), jnp.bfloat16)
        f = jax.jit(functools.partial(moe_layer, top_k=dims.k, config=cfg, interpret=interpret))
        for _ in range(a.calls):
            jax.block_until_ready(f(x, rw, rb, ex))
        print(f"{spec}: {a.calls} calls done ({cfg})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
