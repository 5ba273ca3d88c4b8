#!/usr/bin/env python3
"""GPU check of the MoE down GEMM's side product (`moe_mgpu.SideProduct`, the decode output
projection riding in the down GEMM's launch, KESTREL_JAX_PROJ_IN_DOWN): at production shapes
(64 FP8 experts, top-8, D 2048, I 1024; side [8, 2048] x [2048, 2048] bf16) the expert rows with
the side product must combine to the same MoE output as those without it, bit for bit, and the
side partials' sum must match the product computed in float64 (error relative to its largest
magnitude; exit status 1 if either fails). `--small` runs the interpreted kernels at test sizes
on the CPU (a smoke run).

  PYTHONPATH=. python3 tools/check_side_product.py --tokens 1 3 --out side.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel_jax.pallas import mgpu_interpret, moe_mgpu  # noqa: E402
from kestrel_jax.pallas.decode_residual import combine_rows  # noqa: E402
from kestrel_jax.pallas.moe import ExpertWeights, quantize_experts  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--small", action="store_true", help="test sizes, interpreted (CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if any(not 1 <= t <= 8 for t in a.tokens):
        ap.error(f"--tokens must be in [1, 8] (the side product's 8-row block), got {a.tokens}")
    E, D, I, k = (16, 256, 128, 4) if a.small else (64, 2048, 1024, 8)  # noqa: E741
    K2, N2 = (384, 256) if a.small else (D, D)
    interpret = mgpu_interpret.params() if a.small else None
    rng = np.random.default_rng(a.seed)
    up, us = quantize_experts(jnp.asarray(rng.standard_normal((E, 2 * I, D)) / math.sqrt(D), jnp.bfloat16))
    down, ds = quantize_experts(jnp.asarray(rng.standard_normal((E, D, I)) / math.sqrt(I), jnp.bfloat16))
    ex = ExpertWeights(up, down, us, ds)
    rw = jnp.asarray(rng.standard_normal((D, E)) / math.sqrt(D), jnp.bfloat16)
    rb = jnp.zeros((E,), jnp.bfloat16)
    sw = jnp.asarray(rng.standard_normal((K2, N2)) / math.sqrt(K2), jnp.bfloat16)
    res: dict = {"device": jax.devices()[0].device_kind, "small": a.small, "cases": []}
    for t in a.tokens:
        cfg = moe_mgpu.default_config(t, num_ctas=3 if a.small else None)
        x = jnp.pad(jnp.asarray(rng.standard_normal((t, D)), jnp.bfloat16), ((0, cfg.block_tokens - t), (0, 0)))
        sx = jnp.pad(jnp.asarray(rng.standard_normal((t, K2)), jnp.bfloat16), ((0, 8 - t), (0, 0)))

        def rows(x, sx, side: bool, cfg=cfg, t=t):
            r = moe_mgpu.moe_layer_rows(x, rw, rb, ex, top_k=k, config=cfg, interpret=interpret, tokens=t,
                                        side=(sx, sw) if side else None)
            assert r is not None
            return combine_rows(r, t, jnp.float32), r.side  # (block rows no routed token reads: unwritten)

        y0, _ = jax.jit(lambda x, sx: rows(x, sx, False))(x, sx)
        y1, parts = jax.jit(lambda x, sx: rows(x, sx, True))(x, sx)
        if parts is None:
            raise SystemExit(f"tokens {t}: the side product did not fit in the down GEMM's launch")
        got = np.asarray(parts, np.float64).sum(0).T[:t]
        want = np.asarray(sx, np.float64)[:t] @ np.asarray(sw, np.float64)
        case = {"tokens": t, "splits": int(parts.shape[0]),
                "rows_equal": bool(np.array_equal(np.asarray(y0), np.asarray(y1))),
                "side_max_rel": float(np.abs(got - want).max() / np.abs(want).max())}
        res["cases"].append(case)
        print(json.dumps(case), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    bad = [c for c in res["cases"] if not c["rows_equal"] or c["side_max_rel"] > 1e-5]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
