#!/usr/bin/env python3
"""The MD3 tau products on the GPU: `tau_dots_kernel` (configs swept) against the jnp path XLA
compiles (GELU pass + GEMM), per layer at MD3 shapes (u [T, 6144] bf16, wq / wv [32, 6144]), with
the largest difference from the jnp path. Times are CUPTI sums of the kernels of one call (median
over iterations), the achieved bandwidth counts one read of u and the weights.

  PYTHONPATH=. python3 tools/bench_tau_dots.py --rows 16,64,740,2048 --out $OUT/tau_dots.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel_jax.pallas import tau_dots as td  # noqa: E402
from tools.probe_step_kernels import per_kernel  # noqa: E402


def _sum_then_tanh(oq: jax.Array, ov: jax.Array) -> jax.Array:
    # what the model does next with the products (the kernel's split sum folds into it)
    return jnp.tanh(oq.astype(jnp.float32)) + jnp.tanh(ov.astype(jnp.float32))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="16,64,740,2048")
    ap.add_argument("--dim", type=int, default=6144)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--interpret", action="store_true", help="CPU smoke run (host timing)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    n, h = a.dim, a.heads
    wq = jnp.asarray(rng.standard_normal((h, n)) * 0.02, jnp.bfloat16)
    wv = jnp.asarray(rng.standard_normal((h, n)) * 0.02, jnp.bfloat16)
    res: dict[str, Any] = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "dim": n, "heads": h,
                           "cases": {}}
    ref_fn = jax.jit(lambda u, wq, wv: _sum_then_tanh(*td.tau_dots_ref(u, wq, wv)))
    for t in [int(x) for x in a.rows.split(",")]:
        u = jnp.asarray(rng.standard_normal((t, n)) * 2.0, jnp.bfloat16)
        nbytes = (t * n + 2 * h * n) * 2
        ref_rows, how = per_kernel(ref_fn, (u, wq, wv), a.iters)
        ref_us = sum(r["us"] for r in ref_rows)
        want = np.asarray(jax.jit(td.tau_dots_ref)(u, wq, wv)[0], np.float32)
        case: dict[str, Any] = {"xla_us": round(ref_us, 2), "xla_kernels": ref_rows, "timing": how, "configs": []}
        print(f"T={t}: XLA path {ref_us:.2f} us ({len(ref_rows)} kernels, {how})", flush=True)
        grid = itertools.product((16, 32, 64), (1, 2, 4, 8), (128, 256), (4, 8))
        for br, sp, bc, nw in grid:
            cfg = td.TauDotsConfig(block_rows=br, splits=sp, block_cols=bc, num_warps=nw)
            if td.tau_dots_problem(u, wq, wv, cfg) is not None or (t <= 64 and br > 32) or (t > 64 and br < 32):
                continue
            fn = jax.jit(lambda u, wq, wv, cfg=cfg: _sum_then_tanh(
                *td.tau_dots_kernel(u, wq, wv, config=cfg, interpret=a.interpret)))
            try:
                rows, _ = per_kernel(fn, (u, wq, wv), a.iters)
                got = np.asarray(td.tau_dots_kernel(u, wq, wv, config=cfg, interpret=a.interpret)[0], np.float32)
            except Exception as e:  # noqa: BLE001 - a sweep: record and go on
                case["configs"].append({"config": cfg._asdict(), "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            us = sum(r["us"] for r in rows)
            diff = float(np.abs(got - want).max())
            case["configs"].append({"config": cfg._asdict(), "us": round(us, 2), "kernels": len(rows),
                                    "gbs": round(nbytes / us / 1e3, 1), "max_diff": diff,
                                    "ref_max": float(np.abs(want).max())})
        ok = [c for c in case["configs"] if "us" in c]
        ok.sort(key=lambda c: c["us"])
        for c in ok[:6]:
            print(f"   {c['us']:8.2f} us {c['gbs']:7.1f} GB/s diff {c['max_diff']:.3g} {c['config']}", flush=True)
        bad = [c for c in case["configs"] if "error" in c]
        if bad:
            print(f"   {len(bad)} configs failed, first: {bad[0]['error']}", flush=True)
        dflt = td.default_config(t)
        mine = [c for c in ok if c["config"] == dflt._asdict()]
        if mine:
            print(f"   default {dflt}: {mine[0]['us']:.2f} us", flush=True)
        res["cases"][t] = case
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
