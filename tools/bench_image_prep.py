"""Host-side image preparation per request: decode, overlap crops, content digest.

Times what the engine runs on the CPU before an image request reaches the scheduler
(`InferenceEngine._prepare_image`): decoding the encoded bytes, the overlap crops (PIL LANCZOS,
split across `kestrel_jax.models.image_crops.IMAGE_THREADS` threads) and the prefix-cache digest,
for the image sizes of the benchmark's W4, with one thread and with the default thread count.
Median of `--reps` runs per cell; prints CPU count and versions; `--json` writes the table.

    python tools/bench_image_prep.py [--sizes 378x378 756x756 768x1024 3000x4000] [--reps 20]
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import PIL
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel_jax.models import image_crops  # noqa: E402
from kestrel_jax.models.config import md3_config  # noqa: E402


def _median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["378x378", "756x756", "768x1024", "3000x4000"],
                   help="HxW image sizes")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    vision = md3_config().vision
    print(f"cpus {os.cpu_count()}, python {platform.python_version()}, pillow {PIL.__version__}, numpy "
          f"{np.__version__}, image threads {image_crops.IMAGE_THREADS}, PIL pass order "
          f"{image_crops.pass_order_rule()}")
    rng = np.random.default_rng(0)
    rows = []
    for spec in a.sizes:
        h, w = (int(v) for v in spec.split("x"))
        # A smooth picture with noise: compresses like a photo, not like white noise.
        yy, xx = np.mgrid[0:h, 0:w]
        base = np.stack([(xx * 255 // max(w - 1, 1)), (yy * 255 // max(h - 1, 1)), ((xx + yy) % 256)], -1)
        img = np.clip(base + rng.integers(-20, 21, (h, w, 3)), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=90)
        data = buf.getvalue()
        decoded = image_crops.load_image(data)
        crops, tiling = image_crops.overlap_crops(decoded, vision)
        row = {"image": spec, "crops": int(crops.shape[0]), "tiling": list(tiling), "jpeg_kb": len(data) // 1024,
               "decode_ms": _median_ms(functools.partial(image_crops.load_image, data), a.reps)}
        for label, threads in (("1_thread", 1), ("default", image_crops.IMAGE_THREADS)):
            old = image_crops.IMAGE_THREADS
            image_crops.IMAGE_THREADS = threads
            try:
                # the same crops either way (the split is byte-exact); checked here on the real sizes
                again, _ = image_crops.overlap_crops(decoded, vision)
                assert np.array_equal(again, crops), f"{spec}: crops differ with {threads} threads"
                crop = functools.partial(image_crops.overlap_crops, decoded, vision)
                row[f"crops_ms_{label}"] = _median_ms(crop, a.reps)
                row[f"digest_ms_{label}"] = _median_ms(functools.partial(image_crops.pixels_digest, crops), a.reps)
            finally:
                image_crops.IMAGE_THREADS = old
        rows.append(row)
        print(json.dumps(row))
    if a.json is not None:
        a.json.write_text(json.dumps({"cpus": os.cpu_count(), "pillow": PIL.__version__,
                                      "image_threads": image_crops.IMAGE_THREADS, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
