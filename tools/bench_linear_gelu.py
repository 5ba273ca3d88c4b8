#!/usr/bin/env python3
"""fc1 with its GELU fused (`dense_mgpu.linear_gelu`) vs XLA's GEMM + GELU pass (GPU).

    python3 tools/bench_linear_gelu.py --out $OUT/linear_gelu.json

Cases (M x K x N): MD2's dense MLP fc1 in the prefill and mixed steps (768 / 1536 / 2048 prefill
tokens, and 1536 + 64 decode rows), and the vision encoder's fc1 over four one-crop images with
N padded to a multiple of 128 (4304 -> 4352). One timed call runs `--layers` layers, each with its
own weights (as a step reads them). Variants: `xla` is the model's unfused expressions (Linear,
then gelu_tanh) compiled by XLA; `xla_gemm` the product and bias alone (what the GELU pass costs
is the difference); `kernel/BNxS` the fused kernel with column tile BN and S ring stages. Prints
the device and versions, us per layer (CUPTI sum of kernel durations), kernels per layer, TFLOP/s
of the product, and against `xla` the largest difference relative to the output's largest value
and the fraction of outputs that differ (XLA's bf16 GELU rounds after each step; the kernel's
runs in f32 and rounds once).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, installed or not

from kestrel_jax.models.layers import gelu_tanh  # noqa: E402
from kestrel_jax.pallas import dense_mgpu as D  # noqa: E402

CASES = {
    "md2_prefill768": (768, 2048, 8192),
    "md2_prefill1536": (1536, 2048, 8192),
    "md2_mixed": (1600, 2048, 8192),
    "md2_prefill2048": (2048, 2048, 8192),
    "vision4": (2916, 1152, 4352),
}


def measure(f, args, iters: int) -> tuple[float, int]:
    """Median us per call (CUPTI sum of kernel durations) and kernels per call."""
    from jax.experimental.mosaic.gpu import profiler

    _, per_iter = profiler.measure(f, aggregate=False, iterations=max(iters, 2))(*args)
    if not per_iter:
        raise RuntimeError("CUPTI returned no kernel timings")
    return statistics.median(sum(t for _, t in ks) for ks in per_iter) * 1e3, len(per_iter[0])


def differences(a: jax.Array, b: jax.Array) -> tuple[float, float]:
    """Largest |a - b| relative to max |b|, and the fraction of elements that differ."""
    fa, fb = np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
    d = np.abs(fa - fb)
    return float(d.max() / np.abs(fb).max()), float((d > 0).mean())


def run_case(name: str, layers: int, iters: int, variants: list[tuple[int, int]]) -> list[dict[str, Any]]:
    M, K, N = CASES[name]
    keys = jax.random.split(jax.random.key(M + K + N), 3)
    x = jax.random.normal(keys[0], (M, K), jnp.float32).astype(jnp.bfloat16)
    ws = (jax.random.normal(keys[1], (layers, K, N), jnp.float32) * K ** -0.5).astype(jnp.bfloat16)
    bs = (jax.random.normal(keys[2], (layers, N), jnp.float32) * 0.1).astype(jnp.bfloat16)
    flops = 2 * M * K * N

    def layered(fn):
        def f(x, ws, bs):
            return [fn(x, ws[i], bs[i]) for i in range(layers)]
        return jax.jit(f)

    todo: list[tuple[str, Any]] = [
        ("xla", layered(lambda x, w, b: gelu_tanh(jnp.dot(x, w) + b))),
        ("xla_gemm", layered(lambda x, w, b: jnp.dot(x, w) + b)),
    ]
    for bn, st in variants:
        if D.problem(x, ws[0], bs[0], block_n=bn, stages=st) is None:
            todo.append((f"kernel/{bn}x{st}", layered(
                lambda x, w, b, bn=bn, st=st: D.linear_gelu(x, w, b, block_n=bn, stages=st))))
    ref = todo[0][1](x, ws, bs)
    rows = []
    for label, f in todo:
        try:
            out = f(x, ws, bs)
            diff = None if label == "xla_gemm" else [max(v) for v in zip(*(
                differences(o, r) for o, r in zip(out, ref, strict=True)), strict=True)]
            us, launches = measure(f, (x, ws, bs), iters)
        except Exception as e:  # a config the compiler refuses: report it, keep going
            print(f"{name} {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        per = us / layers
        rows.append({"case": name, "M": M, "K": K, "N": N, "variant": label, "us_per_layer": round(per, 2),
                     "kernels_per_layer": round(launches / layers, 2), "tflops": round(flops / per / 1e6, 1),
                     "vs_xla_max_rel_diff_and_fraction_differing": diff})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--variants", nargs="+", default=["128x3", "128x4", "64x4"], metavar="BNxSTAGES")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if jax.default_backend() != "gpu":
        sys.exit("bench_linear_gelu.py needs a GPU")
    t0 = time.time()
    info = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "layers": args.layers,
            "num_ctas": D._device_sms()}
    print(json.dumps(info), flush=True)
    variants = [(int(v.split("x")[0]), int(v.split("x")[1])) for v in args.variants]
    results = []
    for name in args.cases.split(","):
        for r in run_case(name, args.layers, args.iters, variants):
            results.append(r)
            print(f"{r['case']:16s} {r['M']}x{r['K']}x{r['N']}  {r['variant']:12s} {r['us_per_layer']:8.2f} us/layer  "
                  f"{r['kernels_per_layer']} kernels/layer  {r['tflops']:6.1f} TFLOP/s  "
                  f"vs xla (max rel diff, fraction differing) {r['vs_xla_max_rel_diff_and_fraction_differing']}",
                  flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"info": info, "results": results, "wall_s": round(time.time() - t0, 1)}, fh, indent=1)


if __name__ == "__main__":
    main()
