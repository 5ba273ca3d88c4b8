"""Write a random Moondream checkpoint (real names, shapes, dtypes) for tests and benchmarks.

    python tools/make_synthetic_checkpoint.py --model md3 --out /tmp/md3-random --seed 0
    python tools/make_synthetic_checkpoint.py --model tiny-md3 --out /tmp/t --seed 1 --shards 3 \
        --fp8-experts --kv-scales --layout internal

Full-size MD3 is ~18.5 GB (bf16) and is streamed to disk, so memory stays small.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from kestrel_jax.checkpoint import CheckpointError, write_synthetic_checkpoint  # noqa: E402
from kestrel_jax.models.config import (  # noqa: E402
    MoondreamConfig,
    md2_config,
    md3_1_config,
    md3_config,
    tiny_config,
)

MODELS: dict[str, Callable[[], MoondreamConfig]] = {
    "md2": md2_config,
    "md3": md3_config,
    "md3.1": md3_1_config,
    "tiny-md2": lambda: tiny_config("md2"),
    "tiny-md3": lambda: tiny_config("md3"),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, choices=sorted(MODELS))
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", required=True, type=int)
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--layout", choices=["hf", "internal"], default="hf")
    ap.add_argument("--fp8-experts", action="store_true", help="MoE experts as e4m3 + per-row scales")
    ap.add_argument("--kv-scales", action="store_true", help="per-layer k/v scales for an FP8 KV cache")
    ap.add_argument("--region-ln", action=argparse.BooleanOptionalAction, default=None,
                    help="MD3 region LayerNorm (default: as the model preset; md3.1 has it)")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--std", type=float, default=0.02)
    ap.add_argument("--suppress-ids", type=int, default=16, help="lm_head bias -1e4 on ids below this")
    ap.add_argument("--no-tokenizer", action="store_true")
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    try:
        out = write_synthetic_checkpoint(
            args.out, MODELS[args.model](), seed=args.seed, layout=args.layout, shards=args.shards,
            fp8_experts=args.fp8_experts, kv_scales=args.kv_scales, region_ln=args.region_ln,
            std=args.std, suppress_ids=args.suppress_ids, dtype=args.dtype,
            tokenizer=not args.no_tokenizer, overwrite=args.overwrite, progress=not args.quiet,
        )
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"wrote {out} ({size / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
