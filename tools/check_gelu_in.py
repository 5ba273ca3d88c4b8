#!/usr/bin/env python3
"""GPU check of the decode GEMM kernel forming its own input row for a dense layer's joined output
+ fc2 product (`gemv_mgpu.gemv_gelu_in`, KESTREL_JAX_DENSE_OUT_GELU_IN) at Moondream's shapes
(attention output [1, 2048], the joined QKV + fc1 product [8, 14336] with fc1 from column 6144,
the joined weight [10240, 2048], 5 K ranges): on fresh random rows the product must lie within
bf16 rounding of `gemv_gelu_in_ref` (the row [o, GELU_tanh(fc1)] formed in f32 with jax.nn.gelu,
the product in f32; `gemv_gelu_in_allowance`), exit status 1 otherwise. It also reports whether
the product equals, bit for bit, the same kernel's on the row formed by XLA with the kernel's GELU
formula (`gelu_tanh_exp`) and padded to 8 rows, and how far the default path (XLA's concat + GELU +
pad, 4 K ranges) lies from the reference. `--small` runs the interpreted kernel at test sizes on the CPU (a smoke run).

  PYTHONPATH=. python3 tools/check_gelu_in.py --draws 4 --out gelu_in.json
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

from kestrel_jax.pallas import gemv_mgpu as g  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draws", type=int, default=4, help="fresh inputs")
    ap.add_argument("--small", action="store_true", help="test sizes, interpreted (CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    D, F, Q, N = (256, 768, 192, 128) if a.small else (2048, 8192, 6144, 2048)
    splits = g.gelu_in_splits(D, D + F, 4)
    rng = np.random.default_rng(a.seed)

    def bf16(shape, std):
        return jnp.asarray(rng.standard_normal(shape) * std, jnp.bfloat16)

    w, b = bf16((D + F, N), 1 / math.sqrt(D + F)), bf16((N,), 0.1)
    kernel = jax.jit(lambda o, j: g.gemv_gelu_in(o, j, w, b, splits=splits, h_col=Q, interpret=a.small))

    def on_xla_row(o, j, formula, s):
        row = jnp.concatenate([o, formula(j[:1, Q:].astype(jnp.float32)).astype(jnp.bfloat16)], axis=1)
        return g.gemv(row, w, b, splits=s, interpret=a.small)

    same_row = jax.jit(lambda o, j: on_xla_row(o, j, g.gelu_tanh_exp, splits))
    default = jax.jit(lambda o, j: on_xla_row(o, j, lambda v: jax.nn.gelu(v, approximate=True), 4))
    res: dict = {"device": jax.devices()[0].device_kind, "small": a.small, "splits": splits, "cases": []}
    for d in range(a.draws):
        o = bf16((1, D), rng.uniform(0.2, 2.0))
        joined = bf16((8, Q + F), rng.uniform(0.5, 4.0))
        got = np.asarray(kernel(o, joined).astype(jnp.float32))
        want = np.asarray(g.gemv_gelu_in_ref(o, joined, w, b, h_col=Q).astype(jnp.float32))
        dflt = np.asarray(default(o, joined).astype(jnp.float32))
        scale = np.abs(want).max()
        tol = g.gemv_gelu_in_allowance(o, joined, w, b, jnp.asarray(want), Q)
        case = {"draw": d, "shape": list(got.shape),
                "within_rounding": bool((np.abs(got - want) <= tol).all()),
                "max_rel_diff": float(np.abs(got - want).max() / scale),
                "default_path_max_rel_diff": float(np.abs(dflt - want).max() / scale),
                "equal_to_kernel_on_xla_row": bool(np.array_equal(got, np.asarray(
                    same_row(o, joined).astype(jnp.float32)))),
                "finite": bool(np.isfinite(got).all())}
        res["cases"].append(case)
        print(json.dumps(case), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 1 if any(not (c["within_rounding"] and c["finite"] and c["shape"] == [1, N]) for c in res["cases"]) else 0


if __name__ == "__main__":
    sys.exit(main())
