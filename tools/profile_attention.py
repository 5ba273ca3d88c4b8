#!/usr/bin/env python3
"""Run a few attention kernel calls for an external profiler (Nsight Compute) to capture.

    ncu -k regex:kestrel --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python3 tools/profile_attention.py decode:8x512 decode:32x128 prefill:740

Each case builds random FP8 inputs at production head counts (32 x 64, page 64), compiles the
kernel with its default settings (or `key=value` overrides after the case, e.g.
`decode:32x128:heads_per_cta=1`), and calls it `--calls` times. It prints nothing of its own
timing: use tools/bench_attention.py for times.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: the bench's input builders

from bench_attention import decode_inputs  # noqa: E402

from kestrel_jax.pallas import paged_attention_mgpu as pm  # noqa: E402
from kestrel_jax.pallas import paged_attention_prefill_mgpu as pp  # noqa: E402

PAGE = 64


def _overrides(parts: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in parts:
        k, v = kv.split("=", 1)
        if "/" in v:  # registers=232/40
            out[k] = tuple(int(x) for x in v.split("/"))
        else:
            out[k] = v == "True" if v in ("True", "False") else int(v)
    return out


def run_case(spec: str, calls: int, rng: np.random.Generator) -> None:
    kind, shape, *rest = spec.split(":")
    kw = _overrides(rest)
    ks, vs = jnp.float32(0.05), jnp.float32(0.04)
    if kind == "decode":
        b, kv = (int(x) for x in shape.split("x"))
        k_pages, v_pages, tables, qs, lens = decode_inputs(rng, b, kv, PAGE, jnp.float8_e4m3fn, 1)
        f = jax.jit(functools.partial(pm.decode_attention_kernel, sm_scale=0.125, **kw))
        args: tuple[Any, ...] = (qs[0], k_pages, v_pages, lens, tables[0], ks, vs)
    elif kind == "prefill":
        t = int(shape)
        k_pages, v_pages, tables, _, _ = decode_inputs(rng, 1, t, PAGE, jnp.float8_e4m3fn, 1)
        q = jax.random.normal(jax.random.key(int(rng.integers(2**31))), (t, 32, 64), jnp.bfloat16)
        cu = jnp.asarray([0, t], jnp.int32)
        f = jax.jit(functools.partial(pp.prefill_attention_kernel, sm_scale=0.125, **kw))
        args = (q, k_pages, v_pages, cu, jnp.asarray([t], jnp.int32), tables[0], jnp.asarray([min(t, 730)], jnp.int32),
                ks, vs)
    else:
        raise SystemExit(f"unknown case kind {kind!r} (decode:BxKV or prefill:T)")
    for _ in range(calls):
        out = f(*args)
    jax.block_until_ready(out)
    print(f"{spec}: {calls} calls done", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", nargs="+", help="decode:BxKV[:key=value...] or prefill:T[:key=value...]")
    p.add_argument("--calls", type=int, default=3)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    for spec in args.cases:
        run_case(spec, args.calls, rng)


if __name__ == "__main__":
    main()
