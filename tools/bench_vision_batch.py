#!/usr/bin/env python3
"""One-crop images encoded together (`RunnerConfig.vision_image_batches`): the image step for G
images of one crop each against G one-image steps, on random full-size weights made on the device.
Per G: ms per step and per image (back-to-back launches, median of --reps rounds of --iters),
images/s, achieved bf16 TFLOP/s of the encoder's GEMMs, and the largest difference between an
image's tokens from the G-image step and from its own step, relative to the tokens' max.

With --launch, also the host time of one launch (the call until it returns, the device idle and
each call on other input and output buffers, as the engine's vision thread sees it: XLA updates
the step's command buffer, then launches it), median of --iters x --reps launches. --variants
compiles the steps once per value of XLA's per-program `xla_gpu_enable_command_buffer` option
(NAME=TYPES, TYPES a comma list of command types, empty for none; or `default`) and measures them in turn in one
process; each variant's tokens are compared with the first's.

  PYTHONPATH=. python3 tools/bench_vision_batch.py --model md3 --images 1 2 3 4 6 8 --out vb.json
  PYTHONPATH=. python3 tools/bench_vision_batch.py --model md2 --images 1 4 --launch \
      --variants default nocudnn=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL
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

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, installed or not


def encoder_flops(vis: object, images: int) -> float:
    """Multiply-adds x 2 of the encoder's and projector's GEMMs and attention for one-crop images."""
    t, e = vis.n_patches, vis.enc_dim  # type: ignore[attr-defined]
    per_layer = 2 * t * (4 * e * e + 2 * e * vis.enc_ff_dim) + 4 * t * t * e  # type: ignore[attr-defined]
    proj = 2 * t * (2 * e * vis.proj_inner_dim + vis.proj_inner_dim * vis.proj_out_dim)  # type: ignore[attr-defined]
    patch = 2 * t * vis.patch_dim * e  # type: ignore[attr-defined]
    return float(images * (vis.enc_n_layers * per_layer + proj + patch))  # type: ignore[attr-defined]


def parse_variants(specs: list[str]) -> list[tuple[str, str | None]]:
    """`default` or NAME=TYPES -> (name, the xla_gpu_enable_command_buffer value or None)."""
    out: list[tuple[str, str | None]] = []
    for spec in specs:
        name, eq, types = spec.partition("=")
        if not name or (not eq and name != "default"):  # NAME= (no types): no command buffers
            raise SystemExit(f"--variants: expected default or NAME=TYPES, got {spec!r}")
        if name in {n for n, _ in out}:
            raise SystemExit(f"--variants: {name!r} given twice")
        out.append((name, types.strip() if eq else None))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="md3", choices=["md2", "md3", "tiny-md2"])
    ap.add_argument("--images", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    ap.add_argument("--attention", default="auto", choices=["auto", "xla", "cudnn"])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--launch", action="store_true", help="also time one launch's host time (device idle)")
    ap.add_argument("--variants", nargs="+", default=["default"],
                    help="NAME=TYPES (xla_gpu_enable_command_buffer for the vision steps) or default")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    variants = parse_variants(a.variants)
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from kestrel_jax.models.config import md2_config, md3_config, tiny_config
    from kestrel_jax.models.vision import VisionEncoder, tile_pool_matrices
    from kestrel_jax.serving.runner import _vision_attention, _vision_images_step, _vision_step

    cfg = {"md2": md2_config, "md3": md3_config, "tiny-md2": lambda: tiny_config("md2")}[a.model]()
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    vis = cfg.vision
    enc = VisionEncoder(vis, dtype=dtype, rngs=nnx.Rngs(0))
    gd, state = nnx.split(enc)
    params, treedef = jax.tree.flatten(state)
    params = jax.device_put(params)
    attn = _vision_attention(a.attention, dtype) if a.attention == "auto" else a.attention
    rows, cols = tile_pool_matrices((1, 1), vis, 1)
    rng = np.random.default_rng(0)
    most = max(a.images)
    pool = [jax.device_put(rng.integers(0, 255, (1, vis.crop_size, vis.crop_size, 3), dtype=np.uint8))
            for _ in range(2 * most)]  # rotated between launches
    res: dict = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "model": a.model,
                 "attention": attn or "xla", "dtype": str(jnp.dtype(dtype)), "rows": []}
    first: dict[int, list[np.ndarray]] = {}  # images -> the first variant's tokens
    for name, types in variants:
        opts = {} if types is None else {"xla_gpu_enable_command_buffer": types}
        one = jax.jit(functools.partial(_vision_step, gd, treedef, dtype, attn), compiler_options=opts)
        many = jax.jit(functools.partial(_vision_images_step, gd, treedef, dtype, attn), compiler_options=opts)
        alone = [np.asarray(one(params, c, rows, cols), np.float32) for c in pool[:most]]

        def run(g: int, k: int, one: Any = one, many: Any = many) -> Any:
            crops = pool[(k % 2) * most:(k % 2) * most + g]
            return one(params, crops[0], rows, cols) if g == 1 else many(params, tuple(crops), rows, cols)

        for g in a.images:
            for _ in range(a.iters):  # compile; the second run records the command buffers
                jax.block_until_ready(run(g, 0))
            times = []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                outs = [run(g, k) for k in range(a.iters)]
                jax.block_until_ready(outs)
                times.append((time.perf_counter() - t0) / a.iters)
            step = statistics.median(times)
            launches = []
            if a.launch:
                for k in range(a.iters * a.reps):
                    t0 = time.perf_counter()
                    out = run(g, k)
                    launches.append(time.perf_counter() - t0)
                    jax.block_until_ready(out)
            got = run(g, 0)
            got = [np.asarray(x, np.float32) for x in ([got] if g == 1 else list(got))]
            diff = max(float(np.abs(x - alone[i]).max() / np.abs(alone[i]).max()) for i, x in enumerate(got))
            ref = first.setdefault(g, got)
            vs_first = max(float(np.abs(x - ref[i]).max() / np.abs(ref[i]).max()) for i, x in enumerate(got))
            row = {"variant": name, "command_buffer": "default" if types is None else types, "images": g,
                   "step_ms": round(step * 1e3, 3), "ms_per_image": round(step * 1e3 / g, 3),
                   "images_per_s": round(g / step, 1), "tflops": round(encoder_flops(vis, g) / step / 1e12, 1),
                   "launch_ms": round(statistics.median(launches) * 1e3, 3) if launches else None,
                   "max_rel_diff_vs_alone": diff, "max_rel_diff_vs_first_variant": vs_first}
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
