"""Device-made overlap crops on this machine's accelerator: byte-equal to PIL's, and how long.

For random images of the benchmark's sizes and of random sizes up to the canvas, compares
`device_crops.make_crops` (jitted, on the default device) with the host's `overlap_crops` byte for
byte, then times the crop step per crop-count bucket (median of `--reps`, after a warm-up call) and
the host-side planning. Exits non-zero on any difference.

    python tools/check_device_crops.py [--random 24] [--reps 50] [--buckets 2 5 10 13]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel_jax.models import device_crops as dc  # noqa: E402
from kestrel_jax.models.config import md3_config  # noqa: E402
from kestrel_jax.models.image_crops import overlap_crops, pass_order_rule  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--random", type=int, default=24, help="random-size images to compare")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--buckets", type=int, nargs="+", default=[2, 5, 10, 13])
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    vision = md3_config().vision
    dev = jax.devices()[0]
    print(f"device {dev.device_kind} ({dev.platform}), jax {jax.__version__}, PIL pass order {pass_order_rule()}, "
          f"canvas {dc.CANVAS}, taps {dc.MAX_TAPS}")
    make = jax.jit(dc.make_crops)
    rng = np.random.default_rng(a.seed)
    sizes = [(756, 756), (1024, 768), (768, 1024), (500, 700), (300, 300), (1000, 90), (379, 378), (640, 480)]
    sizes += [(int(h), int(w)) for h, w in rng.integers(1, dc.CANVAS + 1, (a.random, 2))]
    bad = 0
    plan_ms = []
    for h, w in sizes:
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        t0 = time.perf_counter()
        plan = dc.plan_crops(img, vision)
        plan_ms.append((time.perf_counter() - t0) * 1e3)
        if plan is None:
            print(f"{h}x{w}: no device plan")
            continue
        bucket = next(b for b in sorted(a.buckets) + [plan.num_crops] if b >= plan.num_crops)
        got = np.asarray(make(*plan.padded(bucket)))[:plan.num_crops]
        want, _ = overlap_crops(img, vision)
        if not np.array_equal(got, want):
            bad += 1
            diff = np.abs(got.astype(int) - want)
            print(f"{h}x{w}: DIFFERENT, {int(np.sum(diff > 0))} bytes, max {int(diff.max())}")
    print(f"compared {len(sizes)} images, {bad} different; host planning median {statistics.median(plan_ms):.2f} ms "
          f"(max {max(plan_ms):.2f}, first calls include coefficient tables)")
    for n in a.buckets:  # the gathers cost the same whatever the values: an empty plan of n crops
        host = dc.empty_plan(n, vision.crop_size)
        up = []
        for _ in range(10):
            t0 = time.perf_counter()
            args = jax.block_until_ready([jax.device_put(x) for x in host])
            up.append((time.perf_counter() - t0) * 1e3)
        jax.block_until_ready(make(*args))
        times = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            jax.block_until_ready(make(*args))
            times.append((time.perf_counter() - t0) * 1e3)
        print(f"bucket {n}: crop step {statistics.median(times):.3f} ms (inputs on the device), upload of the "
              f"plan {statistics.median(up):.2f} ms")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
