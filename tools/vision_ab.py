#!/usr/bin/env python3
"""Vision encoder A/B: the runner's fixed-shape image step with XLA vs cuDNN self-attention, per
crop bucket: device time (median of --reps, inputs rotated) and the largest difference between
the two outputs relative to the output's max. Random weights made on the device.

  PYTHONPATH=. python3 tools/vision_ab.py --model md2 --buckets 2 5 10 13 --out vision_ab.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, installed or not


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="md2", choices=["md2", "md3", "tiny-md2"])
    ap.add_argument("--buckets", type=int, nargs="+", default=[2, 5, 10, 13])
    ap.add_argument("--impls", nargs="+", default=["xla", "cudnn"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import jax

    from kestrel_jax.models.config import md2_config, md3_config, tiny_config
    from kestrel_jax.models.moondream import random_model
    from kestrel_jax.serving.runner import Runner, RunnerConfig

    cfgs = {"md2": md2_config, "md3": md3_config, "tiny-md2": lambda: tiny_config("md2")}
    model = random_model(cfgs[a.model]())
    vis = model.cfg.vision
    rng = np.random.default_rng(0)
    res: dict = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "model": a.model, "rows": []}
    outs: dict = {}
    inputs = {n: [rng.integers(0, 255, (n, vis.crop_size, vis.crop_size, 3), dtype=np.uint8) for _ in range(3)]
              for n in a.buckets}  # the same images for every implementation
    for impl in a.impls:
        r = Runner(model, RunnerConfig(num_pages=8, max_seq_len=512, vision_buckets=tuple(a.buckets),
                                       vision_attention=impl))
        for n in a.buckets:
            crops = inputs[n]
            tiling = (1, n - 1)
            try:
                t0 = time.perf_counter()
                first = jax.block_until_ready(r.encode_image(crops[0], tiling))
                compile_s = time.perf_counter() - t0
                times = []
                for i in range(a.reps):
                    t = time.perf_counter()
                    jax.block_until_ready(r.encode_image(crops[i % 3], tiling))
                    times.append(time.perf_counter() - t)
            except Exception as e:  # an implementation that does not run here: say so, go on
                res["rows"].append({"impl": impl, "crops": n, "error": repr(e)[:500]})
                print(res["rows"][-1], flush=True)
                continue
            outs[(impl, n)] = np.asarray(first, np.float32)
            row = {"impl": impl, "crops": n, "ms_median": round(1e3 * float(np.median(times)), 3),
                   "ms_min": round(1e3 * min(times), 3), "first_call_s": round(compile_s, 2)}
            base = outs.get((a.impls[0], n))
            if base is not None and impl != a.impls[0]:
                row["max_rel_diff_vs_" + a.impls[0]] = float(np.max(np.abs(outs[(impl, n)] - base))
                                                              / max(float(np.max(np.abs(base))), 1e-30))
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
        del r
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
