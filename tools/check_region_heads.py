#!/usr/bin/env python3
"""GPU check of the region heads on the decode GEMM kernel (`RegionModel.decode_heads` /
`encode_*` with kernel_rows, as the runner's steps call them at up to
`text.region_kernel_rows()` rows) against XLA's products (kernel_rows=0), on a full-size random
region model: the largest difference of each head's output relative to its largest magnitude,
and for the decoders the share of rows whose argmax bin (the decoded coordinate or size) agrees.

  PYTHONPATH=. python3 tools/check_region_heads.py --model md3 --rows 1 8
  PYTHONPATH=. python3 tools/check_region_heads.py --model md3 --tiny --rows 1   # CPU: both paths XLA
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel_jax.models.config import md2_config, md3_config, tiny_config  # noqa: E402
from kestrel_jax.models.region import RegionModel  # noqa: E402


def compare(region: RegionModel, rows: int, seed: int = 0) -> dict[str, Any]:
    """Kernel path (kernel_rows = rows) against XLA (kernel_rows = 0) for one batch of `rows`."""
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((rows, region.cfg.dim)), jnp.bfloat16)
    v = jnp.asarray(rng.uniform(size=(rows, 2)), jnp.float32)

    def heads(h: jax.Array, v: jax.Array, kernel_rows: int) -> tuple[jax.Array, ...]:
        coord, size = region.decode_heads(h, kernel_rows=kernel_rows)
        return (coord, size, region.encode_coordinate(v[:, :1], jnp.bfloat16, kernel_rows=kernel_rows),
                region.encode_size(v, jnp.bfloat16, kernel_rows=kernel_rows))

    kern = jax.jit(lambda h, v: heads(h, v, rows))(h, v)
    xla = jax.jit(lambda h, v: heads(h, v, 0))(h, v)
    out: dict[str, Any] = {"rows": rows}
    for name, a, b in zip(("coord", "size", "enc_coord", "enc_size"), kern, xla, strict=True):
        a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
        out[name] = {"max_rel": float(np.abs(a32 - b32).max() / max(np.abs(b32).max(), 1e-30)),
                     "finite": bool(np.isfinite(a32).all())}
        if name in ("coord", "size"):
            out[name]["argmax_agree"] = float((a32.argmax(-1) == b32.argmax(-1)).mean())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="md3", choices=["md2", "md3"])
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny region heads (a CPU smoke run)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cfg = tiny_config(a.model) if a.tiny else (md3_config() if a.model == "md3" else md2_config())
    region = RegionModel(cfg.region, dtype=jnp.bfloat16, rngs=nnx.Rngs(3))
    res = {"device": jax.devices()[0].device_kind, "model": a.model,
           "results": [compare(region, r, seed=r) for r in a.rows]}
    for r in res["results"]:
        print(json.dumps(r), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
