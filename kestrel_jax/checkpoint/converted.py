"""Converted checkpoints: the model's own param pytree saved with orbax, config JSON beside it.

Directory layout:
    <dst>/params/                  orbax StandardCheckpointer output (nested dict of arrays)
    <dst>/config.json              the config dict given to `save_converted`
    <dst>/kestrel_converted.json   format marker, written last (a crash leaves no marker)

Leaves may be numpy or jax arrays of any dtype orbax stores, bfloat16 and float8_e4m3fn
included; `restore_converted` without a target gives them back as they were saved (numpy stays
numpy), with a target (arrays or jax.ShapeDtypeStruct with shardings) straight onto devices.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kestrel_jax.checkpoint.spec import CheckpointError

MARKER_NAME = "kestrel_converted.json"
PARAMS_DIR = "params"
CONFIG_NAME = "config.json"
FORMAT = "kestrel_jax.converted"
VERSION = 1


def _checkpointer() -> Any:
    import orbax.checkpoint as ocp  # slow import; only where a converted checkpoint is touched

    return ocp.StandardCheckpointer()


def is_converted_checkpoint(path: str | Path) -> bool:
    """True iff `path` is a directory written by `save_converted` (not an HF checkpoint)."""
    marker = Path(path) / MARKER_NAME
    if not marker.is_file() or not (Path(path) / PARAMS_DIR).is_dir():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("format") == FORMAT


def save_converted(dst: str | Path, config_dict: Mapping[str, Any], params_tree: Any, *,
                   overwrite: bool = False) -> Path:
    """Save `params_tree` (nested dict of arrays) and `config_dict` (JSON-serialisable) to `dst`."""
    dst = Path(dst).resolve()  # orbax wants absolute paths
    try:
        config_text = json.dumps(dict(config_dict), indent=2)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"config for {dst} is not JSON-serialisable: {e}") from e
    if dst.exists() and any(dst.iterdir()):
        if not overwrite:
            raise CheckpointError(f"{dst}: exists and is not empty; pass overwrite=True to replace it")
        if not is_converted_checkpoint(dst):
            raise CheckpointError(f"{dst}: not a converted checkpoint; refusing to overwrite it")
        (dst / MARKER_NAME).unlink()
        shutil.rmtree(dst / PARAMS_DIR)
    dst.mkdir(parents=True, exist_ok=True)
    ckpt = _checkpointer()
    ckpt.save(dst / PARAMS_DIR, params_tree)
    ckpt.wait_until_finished()
    (dst / CONFIG_NAME).write_text(config_text + "\n")
    (dst / MARKER_NAME).write_text(json.dumps({"format": FORMAT, "version": VERSION}) + "\n")
    return dst


def restore_converted(dst: str | Path, target: Any = None) -> tuple[dict[str, Any], Any]:
    """(config dict, params tree) from a `save_converted` directory. `target`: optional pytree of
    arrays / jax.ShapeDtypeStruct (with shardings) fixing structure, dtypes and placement."""
    dst = Path(dst).resolve()
    if not is_converted_checkpoint(dst):
        raise CheckpointError(f"{dst}: not a converted checkpoint (no {MARKER_NAME} / {PARAMS_DIR}/); "
                              "HF checkpoints are read with HFCheckpoint.open")
    version = json.loads((dst / MARKER_NAME).read_text()).get("version")
    if version != VERSION:
        raise CheckpointError(f"{dst}: converted-checkpoint version {version}, this code reads {VERSION}")
    try:
        config = json.loads((dst / CONFIG_NAME).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{dst / CONFIG_NAME}: cannot read ({e})") from e
    try:
        params = _checkpointer().restore(dst / PARAMS_DIR, target)
    except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
        raise CheckpointError(f"{dst / PARAMS_DIR}: restore failed: {e}") from e
    return config, params
