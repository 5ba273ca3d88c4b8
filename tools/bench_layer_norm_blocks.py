#!/usr/bin/env python3
"""The residual + LayerNorm kernel over blocks of rows vs XLA's launches (GPU).

    python3 tools/bench_layer_norm_blocks.py --out $OUT/layer_norm_blocks.json

Cases (rows x width, addends): the vision encoder's four one-crop images (2916 x 1152, one addend:
the attention or MLP output), one crop with no addend (729 x 1152: its first LayerNorm), and the
MD2 / MD3 mixed step (1600 x 2048, two addends: (x + a) + m). One timed call runs `--layers`
layers, each on its own rows (cold in L2, as in a step). `xla` is the model's expressions compiled
by XLA; `kernel/RxW` is `layer_norm_blocks.residual_layer_norm_blocks_kernel` with R rows per
program and W warps. Prints the device and versions, us per layer (CUPTI sum of kernel durations),
kernels per layer, the achieved bandwidth (bytes the op must move: addends and x read, x' and the
normalised rows written) as a fraction of a measured device-to-device copy, and the largest
differences from XLA (x' must be equal; LN(x') within the last bit of its statistics).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, installed or not

from kestrel_jax.pallas import layer_norm_blocks as L  # noqa: E402

CASES = {"vision4": (2916, 1152, 1), "vision1_first": (729, 1152, 0), "mixed": (1600, 2048, 2)}


def measure(f, args, iters: int) -> tuple[float, int]:
    """Median us per call (CUPTI sum of kernel durations) and kernels per call."""
    from jax.experimental.mosaic.gpu import profiler

    _, per_iter = profiler.measure(f, aggregate=False, iterations=max(iters, 2))(*args)
    if not per_iter:
        raise RuntimeError("CUPTI returned no kernel timings")
    return statistics.median(sum(t for _, t in ks) for ks in per_iter) * 1e3, len(per_iter[0])


def copy_gbps(iters: int) -> float:
    x = jax.random.bits(jax.random.key(1), (2**28,), jnp.uint32)  # 1 GiB, read and written
    us, _ = measure(jax.jit(lambda a: a + jnp.uint32(1)), (x,), iters)
    return 2 * x.nbytes / us / 1e3


def run_case(name: str, layers: int, iters: int, variants: list[tuple[int, int]], copy: float) -> list[dict[str, Any]]:
    T, D, n_adds = CASES[name]
    keys = jax.random.split(jax.random.key(T + D + n_adds), 4)
    xs = (jax.random.normal(keys[0], (layers, T, D), jnp.float32) * 3 + 1).astype(jnp.bfloat16)
    adds = tuple(jax.random.normal(keys[1 + i], (layers, T, D), jnp.float32).astype(jnp.bfloat16)
                 for i in range(n_adds))
    scale = jax.random.uniform(keys[3], (layers, D), jnp.float32, 0.5, 1.5).astype(jnp.bfloat16)
    bias = jnp.zeros((layers, D), jnp.bfloat16)
    moved = (1 + n_adds) * T * D * 2 + (2 if n_adds else 1) * T * D * 2

    def layered(fn):
        def f(xs, adds, scale, bias):
            return [fn(xs[i], tuple(a[i] for a in adds), scale[i], bias[i]) for i in range(layers)]
        return jax.jit(f)

    xla = layered(lambda x, a, s, b: L.residual_layer_norm_blocks_ref(x, a, s, b, eps=1e-5))
    ref = xla(xs, adds, scale, bias)
    rows = []
    todo: list[tuple[str, Any]] = [("xla", xla)]
    for r, w in variants:
        todo.append((f"kernel/{r}x{w}", layered(
            lambda x, a, s, b, r=r, w=w: L.residual_layer_norm_blocks_kernel(x, a, s, b, eps=1e-5, block_rows=r,
                                                                             num_warps=w))))
    for label, f in todo:
        out = f(xs, adds, scale, bias)
        x_diff = max(float(jnp.max(jnp.abs(o[0].astype(jnp.float32) - q[0].astype(jnp.float32))))
                     for o, q in zip(out, ref, strict=True))
        n_rel = max(float(jnp.max(jnp.abs(o[1].astype(jnp.float32) - q[1].astype(jnp.float32)))
                          / jnp.max(jnp.abs(q[1].astype(jnp.float32)))) for o, q in zip(out, ref, strict=True))
        us, launches = measure(f, (xs, adds, scale, bias), iters)
        per = us / layers
        rows.append({"case": name, "rows": T, "width": D, "addends": n_adds, "variant": label,
                     "us_per_layer": round(per, 2), "kernels_per_layer": round(launches / layers, 2),
                     "copy_fraction": round(moved / per / 1e3 / copy, 3), "x_max_abs_diff": x_diff,
                     "n_max_rel_diff": n_rel})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--variants", nargs="+", default=None, metavar="ROWSxWARPS",
                   help="rows x warps per program (default: the model's choice for each case's width)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if jax.default_backend() != "gpu":
        sys.exit("bench_layer_norm_blocks.py needs a GPU")
    t0 = time.time()
    copy = copy_gbps(args.iters)
    info = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "layers": args.layers,
            "copy_GBps": round(copy, 1)}
    print(json.dumps(info), flush=True)
    results = []
    for name in args.cases.split(","):
        variants = ([(int(v.split("x")[0]), int(v.split("x")[1])) for v in args.variants] if args.variants
                    else [(L.default_block_rows(CASES[name][1]), L.NUM_WARPS)])
        for r in run_case(name, args.layers, args.iters, variants, copy):
            results.append(r)
            print(f"{r['case']:14s} {r['rows']}x{r['width']} +{r['addends']}  {r['variant']:12s} "
                  f"{r['us_per_layer']:7.2f} us/layer  {r['kernels_per_layer']} kernels/layer  "
                  f"{r['copy_fraction']:.2f} of copy  x' diff {r['x_max_abs_diff']:.1e}  "
                  f"LN diff {r['n_max_rel_diff']:.1e}", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"info": info, "results": results, "wall_s": round(time.time() - t0, 1)}, fh, indent=1)


if __name__ == "__main__":
    main()
