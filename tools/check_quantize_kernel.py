#!/usr/bin/env python3
"""The one-pass FP8 row quantisation kernel (`pallas/quantize_triton.py`) compiled for the device
against XLA's `moe.quantize_rows` of the same rows, at the MoE layer's shapes: how many e4m3 codes
differ (and by how many code steps at most), and whether the scales are identical. Interpreted (the
CPU tests) the two are bit-identical; compiled, Triton's f32 division may round differently.

  PYTHONPATH=. python3 tools/check_quantize_kernel.py --out quant.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, installed or not


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp

    from kestrel_jax.pallas import quantize_triton as qt
    from kestrel_jax.pallas.moe import quantize_rows

    interpret = jax.default_backend() != "gpu"
    # (rows, width, gathered rows): decode activations, prefill activations, gathered token rows
    cases = [(64, 2048, None), (4096, 1024, None), (16384, 1024, None), (1480, 2048, 11840)]
    res: dict = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "interpret": interpret, "rows": []}
    kernel = jax.jit(lambda x, idx: qt.quantize_rows_kernel(x, idx, interpret=interpret))
    ref = jax.jit(lambda x, idx: quantize_rows(x if idx is None else x[idx]))
    for seed in range(a.seeds):
        rng = np.random.default_rng(seed)
        for r, k, c in cases:
            if interpret and r * k > 2**18:
                continue
            x = rng.standard_normal((r, k)) * rng.choice([1e-3, 1.0, 40.0], (r, 1))
            x[:, ::97] *= 30.0  # outliers in every row
            xb = jnp.asarray(x, jnp.bfloat16)
            idx = None if c is None else jnp.asarray(rng.integers(0, r, c), jnp.int32)
            gq, gs = (np.asarray(v) for v in kernel(xb, idx))
            wq, ws = (np.asarray(v) for v in ref(xb, idx))
            g8, w8 = gq.view(np.uint8).astype(np.int32), wq.view(np.uint8).astype(np.int32)
            # e4m3 codes of one sign are ordered like their values: the distance in code steps
            steps = np.where((g8 ^ w8) & 0x80, 999, np.abs(g8 - w8))
            row = {"seed": seed, "rows": r, "width": k, "gathered": c, "codes": int(gq.size),
                   "codes_differing": int((steps > 0).sum()), "max_code_steps": int(steps.max()),
                   "scales_identical": bool(np.array_equal(gs, ws)),
                   "nan_codes": int(np.isnan(gq.astype(np.float32)).sum())}
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    bad = [r for r in res["rows"] if r["max_code_steps"] > 1 or not r["scales_identical"] or r["nan_codes"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
