#!/usr/bin/env python3
"""The dense MoE regime's routing-table program (`moe_route_triton.route_tables`) by warp count (GPU).

    python3 tools/bench_route_tables.py --warps 1 2 4 8 --rows 1 8 64 --out $OUT/route_tables.json

One timed call routes `--layers` layers (each its own [P, 64] logits, top-8), as a decode step
does once per MoE layer; prints us per layer (CUPTI sum of kernel durations) for each logits dtype
(bf16: the packed-key top-k the decode path runs; f32: the same values through the two-reduction
path) and warp count, and checks every variant's tables equal the first one's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, installed or not

from kestrel_jax.pallas.moe_route_triton import route_tables  # noqa: E402


def measure_us(f, args, iters: int) -> float:
    from jax.experimental.mosaic.gpu import profiler

    _, per_iter = profiler.measure(f, aggregate=False, iterations=max(iters, 2))(*args)
    if not per_iter:
        raise RuntimeError("CUPTI returned no kernel timings")
    return statistics.median(sum(t for _, t in ks) for ks in per_iter) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "f32"], choices=["bf16", "f32"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64], help="decode rows (tokens) routed")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if jax.default_backend() != "gpu":
        sys.exit("bench_route_tables.py needs a GPU")
    results = []
    for t in args.rows:
        nt = max(8, -(-t // 8) * 8)
        lg = jax.random.normal(jax.random.key(t), (args.layers, nt, args.experts), jnp.bfloat16)
        nv = jnp.array([t], jnp.int32)
        first = None
        for dt in args.dtypes:
            lgd = lg if dt == "bf16" else lg.astype(jnp.float32)
            for w in args.warps:
                f = jax.jit(lambda lg, nv, w=w, nt=nt: [route_tables(lg[i], nv, top_k=args.top_k, block_tokens=nt,
                                                                      num_warps=w) for i in range(lg.shape[0])])
                out = jax.tree.map(np.asarray, f(lgd, nv))
                same = first is None or all(np.array_equal(a, b) for a, b in zip(
                    jax.tree.leaves(out), jax.tree.leaves(first), strict=True))
                first = out if first is None else first
                us = measure_us(f, (lgd, nv), args.iters) / args.layers
                results.append({"rows": t, "dtype": dt, "warps": w, "us_per_layer": round(us, 3), "same_tables": same})
                print(f"rows {t:3d} {dt} warps {w}: {us:6.2f} us per layer  tables equal to the first's: {same}",
                      flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": jax.devices()[0].device_kind, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
