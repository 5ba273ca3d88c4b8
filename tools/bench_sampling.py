#!/usr/bin/env python3
"""Benchmark the Pallas sampler (kestrel_jax/pallas/sampling_kernel.py) against pure-JAX baselines.

    PYTHONPATH=. python3 tools/bench_sampling.py --out $OUT/sampling.json    # GPU, full (< 4 min)
    PYTHONPATH=. python3 tools/bench_sampling.py --quick                     # GPU, B in {1, 128}, bf16
    PYTHONPATH=. python3 tools/bench_sampling.py --cpu-smoke                 # CPU, interpreted, tiny

Batches {1, 128, 8, 32, 256} x V = 51200, bf16 and f32 logits. For each (batch, dtype) it
compiles the kernel and three pure-JAX baselines (a plain sort-based top-p sampler, argmax, and
jax.random.categorical); for each setting it draws fresh logits, checks the kernel's tokens and
logprobs against sample_reference, and times the kernel and two baselines. A case that fails is
recorded and the rest go on; cases starting after --budget-s are skipped. Exit status 1 if any
case failed or mismatched.

Timing: CUPTI (jax.experimental.mosaic.gpu.profiler.measure, per-kernel durations summed per
call, launch gaps excluded; the kernel's two stages are also reported apart), median over 20
calls on each of R fresh inputs (R * bytes >= ~2x
the 50 MB L2, R <= 4). Each input's measurement starts with a warm-up call, so inputs smaller
than L2 are timed L2-warm, as in the real decode step where the LM head has just written the
logits. If CUPTI fails, the median of host-timed calls (block_until_ready; includes dispatch,
~60 us) is reported and the method column says "host".
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, installed or not

from kestrel_jax.pallas.sampling import RowSampling, SamplingParams, make_sampling_params, sample_reference  # noqa: E402
from kestrel_jax.pallas.sampling_kernel import sample_kernel  # noqa: E402

L2_BYTES = 50 * 2**20
MD2_ANSWER = {"temperature": 0.5, "top_p": 0.3, "suppressed_ids": (3,)}
# name -> (per-row settings cycled over the batch, logits shape). "peaked" adds a few dominant
# tokens (LM-like), "flat" is N(0, 1): many candidates, the most redraws for the kernel.
SETTINGS: dict[str, tuple[list[dict[str, Any]], str]] = {
    "greedy": ([{"temperature": 0.0}], "peaked"),
    "top_p": ([{"temperature": 1.0, "top_p": 0.9}], "peaked"),
    "top_p_flat": ([{"temperature": 1.0, "top_p": 0.5}], "flat"),
    "md3_query": ([{"temperature": 0.2, "top_p": 0.9}], "peaked"),
    "mixed": ([{"temperature": 0.0}, MD2_ANSWER, {"temperature": 0.2, "top_p": 0.9},
               {"temperature": 0.0, "allowed_ids": (5, 0)}, {"temperature": 0.7, "top_k": 50, "top_p": 0.9}],
              "peaked"),
}


def make_logits(key: jax.Array, b: int, v: int, shape: str, dtype) -> jax.Array:
    k1, k2, k3 = jax.random.split(key, 3)
    if shape == "flat":
        return jax.random.normal(k1, (b, v), jnp.float32).astype(dtype)
    z = jax.random.normal(k1, (b, v), jnp.float32) * 2.0
    ids = jax.random.randint(k2, (b, 5), 0, v)
    boost = jax.random.uniform(k3, (b, 5), jnp.float32, 4.0, 12.0)
    return z.at[jnp.arange(b)[:, None], ids].add(boost).astype(dtype)


def make_params(b: int, cycle: list[dict[str, Any]], rng: np.random.Generator, v: int) -> SamplingParams:
    rows = [RowSampling(seed=int(rng.integers(2**32)), step=int(rng.integers(1000)), **cycle[i % len(cycle)])
            for i in range(b)]
    p = make_sampling_params(rows, b, n_allowed=2, n_suppressed=2, vocab_size=v)
    return jax.tree.map(jnp.asarray, p)


def sort_top_p(x: jax.Array, p: SamplingParams) -> jax.Array:
    """The usual pure-JAX sampler: softmax, full sort, cumsum, top-p mask, categorical."""
    t = jnp.maximum(p.temperature, 1e-5)[:, None]
    probs = jax.nn.softmax(x.astype(jnp.float32) / t, axis=-1)
    order = jnp.argsort(-probs, axis=-1)
    ps = jnp.take_along_axis(probs, order, axis=-1)
    drop = jnp.cumsum(ps, axis=-1) - ps > p.top_p[:, None]
    pick = jax.random.categorical(jax.random.key(0), jnp.log(jnp.where(drop, 0.0, ps)), axis=-1)
    tok = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0]
    return jnp.where(p.temperature > 0, tok, jnp.argmax(x, axis=-1)).astype(jnp.int32)


def time_calls(f: Callable, inputs: list[tuple], iters: int, cpu: bool) -> tuple[float, str, dict[str, float]]:
    """Median microseconds per call over all inputs, the method, and the median per kernel."""
    if not cpu:
        try:
            from jax.experimental.mosaic.gpu import profiler

            totals: list[float] = []
            per_kernel: dict[str, list[float]] = {}
            for args in inputs:
                _, measured = profiler.measure(f, aggregate=False, iterations=iters)(*args)
                if not measured:
                    raise RuntimeError("CUPTI saw no kernels")
                runs: list[Any] = list(measured) if iters > 1 else [measured]
                for kernels in runs:
                    totals.append(sum(ms for _, ms in kernels) * 1e3)
                    for name, ms in kernels:
                        per_kernel.setdefault(name, []).append(ms * 1e3)
            breakdown = {k: round(statistics.median(v), 2) for k, v in per_kernel.items()}
            return statistics.median(totals), "cupti", breakdown
        except Exception as e:  # noqa: BLE001 - report and fall back
            print(f"  (CUPTI unavailable: {type(e).__name__}: {e}; host timing)", file=sys.stderr)
    ts = []
    for args in inputs:
        jax.block_until_ready(f(*args))
        for _ in range(iters):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6, "host", {}


def run(args: argparse.Namespace) -> dict[str, Any]:
    cpu = args.cpu_smoke
    v = 4096 if cpu else 51200
    # The target shapes first, so a time-budget cut drops the least important cases.
    batches = [1, 8] if cpu else ([1, 128] if args.quick else [1, 128, 8, 32, 256])
    if args.batches:
        batches = [int(x) for x in args.batches.split(",")]
    dtypes = [jnp.bfloat16] if (cpu or args.quick) else [jnp.bfloat16, jnp.float32]
    iters = 2 if cpu else 20
    rng = np.random.default_rng(args.seed)
    key = jax.random.key(args.seed)
    kernel_kw: dict[str, Any] = {"interpret": True} if cpu else {}
    settings = ["greedy", "top_p", "top_p_flat", "mixed"] if cpu else list(SETTINGS)
    if args.settings:
        settings = [x for x in args.settings.split(",") if x]
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise SystemExit(f"unknown settings {unknown}: choose from {sorted(SETTINGS)}")

    info = {
        "device": str(jax.devices()[0].device_kind),
        "platform": jax.default_backend(),
        "jax": jax.__version__,
        "vocab": v,
        "batches": batches,
        "dtypes": [jnp.dtype(d).name for d in dtypes],
        "settings": {k: SETTINGS[k] for k in settings},
        "mode": "cpu-smoke" if cpu else ("quick" if args.quick else "full"),
        "iterations": iters,
    }
    print(json.dumps(info, indent=1, default=str))
    cases: list[dict[str, Any]] = []
    t_start = time.time()

    impls: dict[str, Callable] = {
        "kernel": lambda x, p: sample_kernel(x, p, **kernel_kw).tokens,
        "sort_top_p": sort_top_p,
        "argmax": lambda x, p: jnp.argmax(x, axis=-1).astype(jnp.int32),
        "categorical": lambda x, p: jax.random.categorical(
            jax.random.key(0), x.astype(jnp.float32) / jnp.maximum(p.temperature, 1e-5)[:, None], axis=-1
        ).astype(jnp.int32),
    }
    # --configs: the kernel again at other tile widths / warp counts (timed, not re-checked:
    # these change speed only, and the unit tests run several widths).
    sweep = []
    for cfg in filter(None, args.configs.split(",")):
        w, nw = (int(x) for x in cfg.split(":"))
        name = f"kernel_w{w}_nw{nw}"
        impls[name] = functools.partial(_kernel_tokens, width=w, num_warps=nw, **kernel_kw)
        sweep.append(name)
    info["configs"] = sweep
    for dtype in dtypes:
        for b in batches:
            nbytes = b * v * jnp.dtype(dtype).itemsize
            r = 1 if cpu else int(min(4, max(2, math.ceil(2 * L2_BYTES / nbytes))))
            compiled = {name: jax.jit(fn) for name, fn in impls.items()}
            for sname in settings:
                if time.time() - t_start > args.budget_s:
                    continue
                cycle, shape = SETTINGS[sname]
                key, sub = jax.random.split(key)
                inputs = [(make_logits(k, b, v, shape, dtype), make_params(b, cycle, rng, v))
                          for k in jax.random.split(sub, r)]
                check = _check(inputs, kernel_kw)
                for name in ("kernel", *sweep, "sort_top_p", "argmax" if sname == "greedy" else "categorical"):
                    case: dict[str, Any] = {"batch": b, "dtype": jnp.dtype(dtype).name, "setting": sname,
                                            "impl": name, "inputs": r, "bytes_per_call": nbytes}
                    if time.time() - t_start > args.budget_s:
                        case["error"] = f"skipped: past the {args.budget_s} s budget"
                        cases.append(case)
                        continue
                    try:
                        us, method, kernels = time_calls(compiled[name], inputs, iters, cpu)
                        case.update(us=round(us, 2), method=method, gbps=round(nbytes / us / 1e3, 1))
                        if name == "kernel":
                            case.update(check)
                        if name.startswith("kernel"):
                            case.update(kernels=kernels)
                    except Exception as e:  # noqa: BLE001 - one failing case must not stop the rest
                        case.update(error=f"{type(e).__name__}: {e}"[:2000])
                        traceback.print_exc()
                    cases.append(case)
                    _print_row(case)
    info["cases"] = cases
    info["wall_s"] = round(time.time() - t_start, 1)
    return info


def _kernel_tokens(x: jax.Array, p: SamplingParams, **kw: Any) -> jax.Array:
    return sample_kernel(x, p, **kw).tokens


def _check(inputs: list[tuple], kernel_kw: dict) -> dict[str, Any]:
    """Kernel vs reference on every input: token agreement and logprob error."""
    try:
        mism = total = 0
        lp_err = 0.0
        for x, params in inputs:
            k = sample_kernel(x, params, return_logprobs=True, **kernel_kw)
            ref = sample_reference(x, params, return_logprobs=True)
            kt, rt = np.asarray(k.tokens), np.asarray(ref.tokens)
            mism += int((kt != rt).sum())
            total += kt.size
            same = kt == rt
            lp_err = max(lp_err, float(np.max(np.abs(np.asarray(k.logprobs) - np.asarray(ref.logprobs))[same],
                                              initial=0.0)))
        # Tokens may differ only where libdevice and XLA math round two scores differently (~1e-6 per row).
        ok = mism <= 1 + total // 1000 and lp_err < 1e-3
        return {"check": "ok" if ok else "MISMATCH", "token_mismatches": mism, "rows_checked": total,
                "max_logprob_err": lp_err}
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        return {"check": f"error: {type(e).__name__}: {e}"[:2000]}


def _print_row(c: dict[str, Any]) -> None:
    us = f"{c['us']:9.2f}" if "us" in c else "        -"
    gb = f"{c['gbps']:7.1f}" if "gbps" in c else "      -"
    tail = c.get("error") or f"{c.get('method', '')} {c.get('check', '')} " + (
        f"mism={c['token_mismatches']}/{c['rows_checked']}" if "token_mismatches" in c else "")
    print(f"B={c['batch']:4d} {c['dtype']:9s} {c['setting']:12s} {c['impl']:12s} {us} us {gb} GB/s  {tail}",
          flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--quick", action="store_true", help="B in {1, 128}, bf16 only")
    ap.add_argument("--cpu-smoke", action="store_true", help="interpreted kernel on CPU, tiny shapes")
    ap.add_argument("--seed", type=int, default=int(time.time()) % 2**31)
    ap.add_argument("--batches", default="", help="comma-separated batch sizes (overrides the list)")
    ap.add_argument("--configs", default="",
                    help="extra kernel configs to time, e.g. 64:4,256:16 (width:warps)")
    ap.add_argument("--settings", default="", help="comma-separated settings to run (default: all)")
    ap.add_argument("--budget-s", type=float, default=200.0, help="skip cases started after this many seconds")
    args = ap.parse_args()
    if not args.cpu_smoke and jax.default_backend() != "gpu":
        print("no GPU backend: use --cpu-smoke", file=sys.stderr)
        return 2
    res = run(args)
    print("\nsummary (us per call; kernel / baseline):")
    by = {(c["batch"], c["dtype"], c["setting"], c["impl"]): c.get("us") for c in res["cases"]}
    for (b, dt, s, impl), us in by.items():
        if impl != "kernel" or us is None:
            continue
        other = "argmax" if s == "greedy" else "sort_top_p"
        base = by.get((b, dt, s, other))
        ratio = f"{us / base:.3f}" if base else "-"
        print(f"  B={b:4d} {dt:9s} {s:12s} kernel {us:9.2f} us   kernel / {other}: {ratio}")
    bad = [c for c in res["cases"] if "error" in c or str(c.get("check", "ok")) != "ok"]
    print(f"\n{len(res['cases'])} cases, {len(bad)} failed or mismatched, wall {res['wall_s']} s, seed {args.seed}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
        print(f"wrote {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
