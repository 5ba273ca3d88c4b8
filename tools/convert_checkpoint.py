#!/usr/bin/env python3
"""HF safetensors checkpoint -> converted (orbax) checkpoint of the project's params.

    python tools/convert_checkpoint.py SRC DST [--fp8-experts on|off|keep] [--dtype bfloat16|float32]

Same as `kestrel-jax convert`. With `--fp8-experts on` the MoE experts are stored as e4m3 with
per-(expert, output row) scales; the engine loads either format (`load_model` tells them apart).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, installed or not

from kestrel_jax.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
