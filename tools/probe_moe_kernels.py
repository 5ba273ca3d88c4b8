#!/usr/bin/env python3
"""Where one MoE layer's time goes, kernel by kernel (GPU): the layer (`ops.moe_layer`, the
engine's path: routing, grouping, the grouped GEMMs and the XLA glue around them) at production
dims with FP8 experts, timed with CUPTI per kernel (median over iterations), and the optimized
HLO of each case written beside it so that fusion names map to the ops they run.

  PYTHONPATH=. python3 tools/probe_moe_kernels.py --tokens 1,740,1544 --out-dir $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel_jax.pallas.moe import ExpertWeights, quantize_experts  # noqa: E402
from kestrel_jax.pallas.moe_mgpu import moe_layer  # noqa: E402
from tools.probe_step_kernels import per_kernel  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,740,1544")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--out-dir", default=None)
    a = ap.parse_args()
    d, inner, e, k = 2048, 1024, 64, 8
    key = jax.random.key(0)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    up = jax.random.normal(k1, (e, 2 * inner, d), jnp.float32) * 0.02
    down = jax.random.normal(k2, (e, d, inner), jnp.float32) * 0.02
    uq, us = quantize_experts(up)
    dq, ds = quantize_experts(down)
    experts = ExpertWeights(uq, dq, us, ds)
    del up, down
    router_w = (jax.random.normal(k3, (d, e), jnp.float32) * 0.05).astype(jnp.bfloat16)
    router_b = jnp.zeros((e,), jnp.bfloat16)
    out_dir = Path(a.out_dir) if a.out_dir else None
    res: dict = {"device": jax.devices()[0].device_kind, "cases": {}}
    for t in [int(s) for s in a.tokens.split(",")]:
        x = (jax.random.normal(jax.random.fold_in(k4, t), (t, d), jnp.float32)).astype(jnp.bfloat16)
        f = jax.jit(lambda x, rw, rb, ex: moe_layer(x, rw, rb, ex, top_k=k))
        compiled = f.lower(x, router_w, router_b, experts).compile()
        if out_dir is not None:
            (out_dir / f"moe_t{t}.hlo.txt").write_text(compiled.as_text() or "")
        rows, how = per_kernel(compiled, (x, router_w, router_b, experts), a.iters)
        if how != "cupti":
            print(f"T={t}: no per-kernel timing: {how}", flush=True)
        total = sum(r["us"] for r in rows)
        res["cases"][t] = {"timing": how, "total_us": round(total, 1), "kernels": rows}
        print(f"T={t}: {total:.1f} us in {sum(r['launches'] for r in rows)} launches", flush=True)
        for r in rows:
            print(f"   {r['us']:8.2f} us  x{r['launches']}  {r['kernel']}", flush=True)
    if out_dir is not None:
        (out_dir / "moe_kernels.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
