"""Helpers for the checkpoint tests: golden location, raw safetensors editing."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kestrel_jax.checkpoint.safetensors_io import StreamingWriter, dtype_code, read_header, read_range

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(os.environ.get("KESTREL_GOLDEN_DIR", REPO.parent / "shared" / "golden"))


def raw_tensors(path: Path) -> dict[str, np.ndarray]:
    """Stored name -> array (stored dtype) of one safetensors file, read with our own reader."""
    from kestrel_jax.checkpoint.safetensors_io import DTYPES

    h = read_header(path)
    return {n: read_range(h, e, e.begin, e.nbytes).view(DTYPES[e.dtype]).reshape(e.shape)
            for n, e in h.entries.items()}


def write_tensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    w = StreamingWriter(path, [(n, dtype_code(a.dtype), a.shape) for n, a in tensors.items()])
    for n, a in tensors.items():
        w.write(n, a)
    w.close()


def edited_copy(src: Path, dst: Path, edit: Callable[[dict[str, np.ndarray]], object],
                filename: str = "model.safetensors") -> Path:
    """Copy checkpoint dir `src` to `dst`, applying `edit` to the tensors of `filename`."""
    shutil.copytree(src, dst)
    tensors = raw_tensors(src / filename)
    edit(tensors)
    (dst / filename).unlink()
    write_tensors(dst / filename, tensors)
    return dst


def edit_config(ckpt: Path, edit: Callable[[dict], object]) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    edit(cfg)
    (ckpt / "config.json").write_text(json.dumps(cfg))
