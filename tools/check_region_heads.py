#!/usr/bin/env python3
"""GPU check of the region heads on the decode GEMM kernel (`RegionModel.decode_heads` /
`encode_*` with kernel_rows, as the runner's steps call them at up to
`text.region_kernel_rows()` rows) against XLA's products (kernel_rows=0), on a full-size random
region model: the largest difference of each head's output relative to its largest magnitude,
and for the decoders the share of rows whose argmax bin (the decoded coordinate or size) agrees.

  PYTHONPATH=. python3 tools/check_region_heads.py --model md3 --rows 1 8
  PYTHONPATH=. python3 tools/check_region_heads.py --model md3 --tiny --rows 1   # CPU: both paths XLA
  PYTHONPATH=. python3 tools/check_region_heads.py --model md2 --rows 1 8 --gate  # gated open / closed
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
from kestrel_jax.pallas import ops  # noqa: E402


def _heads(region: RegionModel, h: jax.Array, v: jax.Array, kernel_rows: int,
           gate: jax.Array | None = None) -> tuple[jax.Array, ...]:
    g = None if gate is None else ops.gate(gate, 0, 0)
    coord, size = region.decode_heads(h, kernel_rows=kernel_rows, gate=g)
    return (coord, size, region.encode_coordinate(v[:, :1], jnp.bfloat16, kernel_rows=kernel_rows, gate=g),
            region.encode_size(v, jnp.bfloat16, kernel_rows=kernel_rows, gate=g))


def _diff(out: dict[str, Any], kern: tuple[jax.Array, ...], xla: tuple[jax.Array, ...],
          scale: tuple[jax.Array, ...] | None = None) -> dict[str, Any]:
    """Each output's largest difference relative to the largest magnitude of `scale`'s (default:
    xla's own) output."""
    for i, (name, a, b) in enumerate(zip(("coord", "size", "enc_coord", "enc_size"), kern, xla, strict=True)):
        a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
        ref = np.abs(np.asarray((scale or xla)[i], np.float32)).max()
        out[name] = {"max_rel": float(np.abs(a32 - b32).max() / max(ref, 1e-30)),
                     "finite": bool(np.isfinite(a32).all())}
        if name in ("coord", "size"):
            out[name]["argmax_agree"] = float((a32.argmax(-1) == b32.argmax(-1)).mean())
    return out


def compare(region: RegionModel, rows: int, seed: int = 0, gate: bool = False) -> dict[str, Any]:
    """Kernel path (kernel_rows = rows) against XLA (kernel_rows = 0) for one batch of `rows`.
    With `gate`, the kernel path runs gated (the step's region column, `ops.Gate`): open (1) it
    must match XLA as ungated does; closed (0) its products are skipped, so its outputs must be
    those of XLA on the same heads with every kernel zeroed (the biases through the layers)."""
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((rows, region.cfg.dim)), jnp.bfloat16)
    v = jnp.asarray(rng.uniform(size=(rows, 2)), jnp.float32)
    xla = jax.jit(lambda h, v: _heads(region, h, v, 0))(h, v)
    out: dict[str, Any] = {"rows": rows}
    if not gate:
        return _diff(out, jax.jit(lambda h, v: _heads(region, h, v, rows))(h, v), xla)
    gated = jax.jit(lambda h, v, g: _heads(region, h, v, rows, g))
    out["open"] = _diff({}, gated(h, v, jnp.ones((1, 1), jnp.int32)), xla)
    graph, state = nnx.split(region)
    zeroed = nnx.merge(graph, jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.zeros_like(x) if "kernel" in str(path[-2:]) else x, state))
    zero_xla = jax.jit(lambda h, v: _heads(zeroed, h, v, 0))(h, v)
    out["closed"] = _diff({}, gated(h, v, jnp.zeros((1, 1), jnp.int32)), zero_xla, scale=xla)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="md3", choices=["md2", "md3"])
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny region heads (a CPU smoke run)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--gate", action="store_true",
                    help="the kernel path gated (KESTREL_JAX_REGION_GATE's column): open and closed")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cfg = tiny_config(a.model) if a.tiny else (md3_config() if a.model == "md3" else md2_config())
    region = RegionModel(cfg.region, dtype=jnp.bfloat16, rngs=nnx.Rngs(3))
    res = {"device": jax.devices()[0].device_kind, "model": a.model,
           "gate": a.gate,
           "results": [compare(region, r, seed=r, gate=a.gate) for r in a.rows]}
    for r in res["results"]:
        print(json.dumps(r), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
