#!/usr/bin/env python3
"""The decode QKV epilogue (tau, rotary, KV write) as one kernel vs the jnp path (GPU).

    python3 tools/bench_qkv_epilogue.py --out $OUT/qkv_epilogue.json

For MD3 (tau, FP8 pool) and MD2 (no tau, bf16 pool) shapes at decode rows M, one timed call runs
`--layers` layers, each with its own u rows and tau weights (cold in L2, as in a decode step), all
writing into one small pool: `kernel` is `qkv_epilogue.decode_qkv_kernel`, `jnp` is what the model
ran before it (`qkv_heads_ref` in XLA + the Mosaic KV write kernel). Prints us per layer (CUPTI
sum of kernel durations, the pool's zero fill excluded), kernels per layer, and the largest
difference of q and of the written K/V rows between the two.

With `--prefill M:SPLIT ...` it times a prefill or mixed step's rows instead (M rows, the first
SPLIT of them a mixed step's decode rows): `jnp` is the model's XLA path (MD3's tau factors,
`qkv_heads_ref`, the KV write kernel, q sliced into its decode and prefill rows) and `prefill/wN`
is `qkv_epilogue.prefill_qkv_kernel` (tau factors from XLA as the model forms them).
"""

from __future__ import annotations

import argparse
import functools
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

from kestrel_jax.pallas import ops  # noqa: E402
from kestrel_jax.pallas import qkv_epilogue as qe  # noqa: E402

MODELS = {  # name -> (H, Hkv, Dh, rotary_dim, theta, tau, pool dtype)
    "md3": (32, 32, 64, 32, 1500000.0, True, jnp.float8_e4m3fn),
    "md2": (32, 32, 64, 32, 10000.0, False, jnp.bfloat16),
}
PAGES, PAGE = 64, 64


def measure(f, args, iters: int) -> tuple[float, dict[str, float], int]:
    """Median us per call without the pool's zero fill, per-kernel means, kernels per call."""
    from jax.experimental.mosaic.gpu import profiler

    _, per_iter = profiler.measure(f, aggregate=False, iterations=max(iters, 2))(*args)
    if not per_iter:
        raise RuntimeError("CUPTI returned no kernel timings")

    def fill(name: str) -> bool:
        return any(s in name.lower() for s in ("broadcast", "memset"))

    totals = [sum(t for n, t in ks if not fill(n)) for ks in per_iter]
    names: dict[str, list[float]] = {}
    for ks in per_iter:
        for n, t in ks:
            names.setdefault(n[:60], []).append(t)
    breakdown = {n: round(sum(v) / len(per_iter) * 1e3, 2) for n, v in names.items()}
    return statistics.median(totals) * 1e3, breakdown, sum(1 for n, _ in per_iter[0] if not fill(n))


def run_case(model: str, M: int, layers: int, iters: int, warps: list[int]) -> list[dict[str, Any]]:
    H, hkv, dh, rot, theta, tau_on, pool_dtype = MODELS[model]
    N = (H + 2 * hkv) * dh
    key = jax.random.split(jax.random.key(7), 4)
    us = jax.random.normal(key[0], (layers, M, N), jnp.bfloat16) * 2
    wq = jax.random.normal(key[1], (layers, H, N), jnp.bfloat16) * 0.02
    wv = jax.random.normal(key[2], (layers, H, N), jnp.bfloat16) * 0.02
    alpha = jax.random.normal(key[3], (layers, H), jnp.bfloat16)
    positions = jnp.arange(M, dtype=jnp.int32) + 800
    slots = jnp.arange(M, dtype=jnp.int32) * 7 + 3
    pages = max(PAGES, -(-(7 * M + 3) // PAGE) + 1)
    ks, vs = jnp.float32(0.02), jnp.float32(0.03)
    kw: dict[str, Any] = dict(n_heads=H, rotary_dim=rot, theta=theta)

    def tau(i):
        return qe.TauWeights(wq[i], wv[i], alpha[i]) if tau_on else None

    def body(step):
        def f(us, wq, wv, alpha):
            kp = jnp.zeros((pages, hkv, PAGE, dh), pool_dtype)
            vp = jnp.zeros_like(kp)
            qs = []
            for i in range(layers):
                q, kp, vp = step(us[i], positions, slots, kp, vp, ks, vs, tau(i))
                qs.append(q)
            return jnp.stack(qs), kp, vp
        return jax.jit(f)

    def jnp_step(u, pos, sl, kp, vp, ks, vs, t):
        q, k, v = qe.qkv_heads_ref(u, pos, t, n_kv_heads=hkv, **kw)
        with ops.use_backend("kernel"):
            kp, vp = ops.write_kv(kp, vp, k, v, sl, ks, vs)
        return q, kp, vp

    def kernel_step(u, pos, sl, kp, vp, ks, vs, t, w):
        return qe.decode_qkv_kernel(u, pos, sl, kp, vp, ks, vs, t, num_warps=w or None, **kw)

    def factors_step(u, pos, sl, kp, vp, ks, vs, t, w):  # XLA forms tau's factors, the kernel the rest
        tq, tv, _ = qe.tau_factors(u, pos, t, ops.tau_gelu())
        return qe.decode_qkv_kernel(u, pos, sl, kp, vp, ks, vs, None, num_warps=w or None, factors=(tq, tv), **kw)

    rows = []
    outs = {}
    many = tau_on and M > qe.MAX_TAU_ROWS  # the model's path past MAX_TAU_ROWS: factors from XLA
    variants = [("jnp", jnp_step)] + [(f"kernel{'+factors' if many else ''}/w{w}",
                                       functools.partial(factors_step if many else kernel_step, w=w)) for w in warps]
    for label, step in variants:
        f = body(step)
        outs[label] = jax.block_until_ready(f(us, wq, wv, alpha))
        total, kernels, launches = measure(f, (us, wq, wv, alpha), iters)
        rows.append({"model": model, "M": M, "variant": label, "layers": layers,
                     "us_per_layer": round(total / layers, 2), "kernels_per_layer": round(launches / layers, 2),
                     "kernels": kernels})
    (qa, ka, va), (qb, kb, vb) = outs["jnp"], outs[variants[1][0]]
    f32 = jnp.float32
    qd = float(jnp.abs(qa.astype(f32) - qb.astype(f32)).max() / jnp.abs(qa.astype(f32)).max())
    kd = float(jnp.abs(ka.astype(f32) - kb.astype(f32)).max() / jnp.abs(ka.astype(f32)).max())
    vd = float(jnp.abs(va.astype(f32) - vb.astype(f32)).max() / jnp.abs(va.astype(f32)).max())
    same = float(np.mean(np.asarray(ka.astype(f32) == kb.astype(f32))))
    for r in rows:
        r.update(q_max_rel_diff=qd, k_max_rel_diff=kd, v_max_rel_diff=vd, k_pool_equal_fraction=same)
    return rows


def run_prefill_case(model: str, M: int, split: int, layers: int, iters: int,
                     warps: list[int]) -> list[dict[str, Any]]:
    H, hkv, dh, rot, theta, tau_on, pool_dtype = MODELS[model]
    N = (H + 2 * hkv) * dh
    key = jax.random.split(jax.random.key(11), 4)
    us = jax.random.normal(key[0], (layers, M, N), jnp.bfloat16) * 2
    wq = jax.random.normal(key[1], (layers, H, N), jnp.bfloat16) * 0.02
    wv = jax.random.normal(key[2], (layers, H, N), jnp.bfloat16) * 0.02
    alpha = jax.random.normal(key[3], (layers, H), jnp.bfloat16)
    positions = (jnp.arange(M, dtype=jnp.int32) + 100) % 2000
    slots = jnp.arange(M, dtype=jnp.int32).at[M - 3:].set(-1)  # three padding rows at the end
    pages = -(-M // PAGE) + 1
    ks, vs = jnp.float32(0.02), jnp.float32(0.03)
    kw: dict[str, Any] = dict(n_heads=H, rotary_dim=rot, theta=theta)

    def tau(i):
        return qe.TauWeights(wq[i], wv[i], alpha[i]) if tau_on else None

    def body(step):
        def f(us, wq, wv, alpha):
            kp = jnp.zeros((pages, hkv, PAGE, dh), pool_dtype)
            vp = jnp.zeros_like(kp)
            parts = []
            for i in range(layers):
                *q, kp, vp = step(us[i], positions, slots, kp, vp, ks, vs, tau(i))
                parts.append(q)
            return [jnp.stack([p[j] for p in parts]) for j in range(len(parts[0]))], kp, vp
        return jax.jit(f)

    def jnp_step(u, pos, sl, kp, vp, ks, vs, t):
        q, k, v = qe.qkv_heads_ref(u, pos, t, n_kv_heads=hkv, gelu=ops.tau_gelu(), **kw)
        with ops.use_backend("kernel"):
            kp, vp = ops.write_kv(kp, vp, k, v, sl, ks, vs)
        return (q[:split], q[split:], kp, vp) if split else (q, kp, vp)

    def kernel_step(u, pos, sl, kp, vp, ks, vs, t, w):
        fac = None
        if t is not None:
            tq, tv, _ = qe.tau_factors(u, pos, t, ops.tau_gelu())
            fac = (tq, tv)
        return qe.prefill_qkv_kernel(u, pos, sl, kp, vp, ks, vs, factors=fac, split=split,
                                     num_warps=w or qe.PREFILL_WARPS, **kw)

    rows = []
    outs = {}
    with ops.use_backend("kernel"):  # tau_gelu: the kernel path's polynomial, as the model runs it
        variants = [("jnp", jnp_step)] + [(f"prefill/w{w}", functools.partial(kernel_step, w=w)) for w in warps]
        for label, step in variants:
            f = body(step)
            outs[label] = jax.block_until_ready(f(us, wq, wv, alpha))
            total, kernels, launches = measure(f, (us, wq, wv, alpha), iters)
            rows.append({"model": model, "M": M, "split": split, "variant": label, "layers": layers,
                         "us_per_layer": round(total / layers, 2),
                         "kernels_per_layer": round(launches / layers, 2), "kernels": kernels})
    f32 = jnp.float32

    def rel(a, b):
        return float(jnp.abs(a.astype(f32) - b.astype(f32)).max() / jnp.abs(a.astype(f32)).max())

    (qa, ka, va), (qb, kb, vb) = outs["jnp"], outs[variants[1][0]]
    qa, qb = jnp.concatenate(qa, axis=1), jnp.concatenate(qb, axis=1)
    same = float(np.mean(np.asarray(ka.astype(f32) == kb.astype(f32))))
    for r in rows:
        r.update(q_max_rel_diff=rel(qa, qb), k_max_rel_diff=rel(ka, kb), v_max_rel_diff=rel(va, vb),
                 k_pool_equal_fraction=same)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="md3,md2")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warps", type=int, nargs="+", default=[0], help="kernel variants (0: the kernel's default)")
    p.add_argument("--prefill", nargs="+", default=None, metavar="M:SPLIT",
                   help="time prefill/mixed rows instead: M rows, the first SPLIT decode rows (e.g. 1600:64 1536:0)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if jax.default_backend() != "gpu":
        sys.exit("bench_qkv_epilogue.py needs a GPU")
    t0 = time.time()
    info = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "layers": args.layers}
    print(json.dumps(info), flush=True)
    results = []
    cases: list[tuple[int, int | None]] = [(m, None) for m in args.rows]
    if args.prefill:
        cases = [(int(c.split(":")[0]), int(c.split(":")[1])) for c in args.prefill]
    for model in args.models.split(","):
        for m, split in cases:
            rs = (run_case(model, m, args.layers, args.iters, args.warps) if split is None
                  else run_prefill_case(model, m, split, args.layers, args.iters, args.warps))
            for r in rs:
                results.append(r)
                print(f"{r['model']} M={r['M']:<3d} {r['variant']:12s} {r['us_per_layer']:7.2f} us/layer  "
                      f"{r['kernels_per_layer']} kernels/layer  q diff {r['q_max_rel_diff']:.1e}  k diff "
                      f"{r['k_max_rel_diff']:.1e}  v diff {r['v_max_rel_diff']:.1e}  k pool equal "
                      f"{r['k_pool_equal_fraction']:.4f}", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"info": info, "results": results, "wall_s": round(time.time() - t0, 1)}, fh, indent=1)


if __name__ == "__main__":
    main()
