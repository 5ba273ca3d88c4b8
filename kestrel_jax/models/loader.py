"""Load a model from a local checkpoint: HF safetensors (validated, streamed) or a converted
(orbax) checkpoint written by `convert_checkpoint`. Never touches the network."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kestrel_jax.checkpoint.converted import is_converted_checkpoint, restore_converted, save_converted
from kestrel_jax.checkpoint.reader import HFCheckpoint
from kestrel_jax.checkpoint.spec import CheckpointError
from kestrel_jax.models.config import MoondreamConfig, config_from_dict, config_to_dict
from kestrel_jax.models.moondream import MoondreamModel, abstract_model
from kestrel_jax.models.weights import load_into_model
from kestrel_jax.pallas.moe import dequantize_experts, quantize_experts

_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}


def _is_expert_weight(name: str, arr: np.ndarray) -> bool:
    return arr.ndim == 3 and name.startswith("text.blocks.") and name.endswith(
        (".mlp.fc1.weight", ".mlp.fc2.weight"))


def _convert_experts(tensors: Iterator[tuple[str, np.ndarray]], *, stored_fp8: bool,
                     want_fp8: bool) -> Iterator[tuple[str, np.ndarray]]:
    """Quantise bf16 experts to e4m3 + per-row scales, or dequantise FP8 experts, on the fly."""
    if stored_fp8 == want_fp8:
        yield from tensors
        return
    pending: dict[str, np.ndarray] = {}
    for name, arr in tensors:
        if not stored_fp8 and _is_expert_weight(name, arr):
            q, s = quantize_experts(jnp.asarray(arr))
            yield name, np.asarray(q)
            yield name[: -len(".weight")] + ".scale", np.asarray(s)
        elif stored_fp8 and (_is_expert_weight(name, arr) or name.endswith((".mlp.fc1.scale", ".mlp.fc2.scale"))):
            base = name.rsplit(".", 1)[0]
            pending[name] = arr
            if base + ".weight" in pending and base + ".scale" in pending:
                w, sc = pending.pop(base + ".weight"), pending.pop(base + ".scale")
                yield base + ".weight", np.asarray(dequantize_experts(jnp.asarray(w), jnp.asarray(sc),
                                                                      jnp.bfloat16))
        else:
            yield name, arr
    if pending:
        raise CheckpointError(f"FP8 experts without matching scales: {sorted(pending)[:4]}")


def _converted_meta(cfg: MoondreamConfig, dtype: jnp.dtype, fp8_experts: bool) -> dict[str, Any]:
    return {"config": config_to_dict(cfg), "family": cfg.family, "name": cfg.name,
            "region_ln": cfg.region.has_ln, "fp8_experts": fp8_experts,
            "dtype": jnp.dtype(dtype).name}


def _flat_params(model: MoondreamModel) -> dict[str, Any]:
    return {".".join(map(str, path)): var.get_value()
            for path, var in nnx.to_flat_state(nnx.state(model))}


def load_model(path: str | Path, *, dtype: jnp.dtype = jnp.bfloat16, fp8_experts: bool | None = None,
               progress: bool = True) -> MoondreamModel:
    """Load a checkpoint directory (or .safetensors file).

    `fp8_experts`: None keeps what the checkpoint stores; True quantises bf16 experts to e4m3
    with per-row scales; False dequantises FP8 experts.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint (only local paths are accepted)")
    if is_converted_checkpoint(path):
        return _load_converted(path, dtype=dtype, fp8_experts=fp8_experts)
    ckpt = HFCheckpoint.open(path, progress=progress)
    want_fp8 = ckpt.fp8_experts if fp8_experts is None else fp8_experts
    if want_fp8 and ckpt.config.text.moe is None:
        raise CheckpointError(f"{path}: FP8 experts requested, but this {ckpt.config.family} model has no MoE")
    tensors = _convert_experts(ckpt.iter_tensors(), stored_fp8=ckpt.fp8_experts, want_fp8=want_fp8)
    return load_into_model(abstract_model(ckpt.config, dtype=dtype, fp8_experts=want_fp8), tensors)


def _load_converted(path: Path, *, dtype: jnp.dtype, fp8_experts: bool | None) -> MoondreamModel:
    meta = json.loads((path / "config.json").read_text())
    cfg = config_from_dict(meta["config"], family=meta["family"])
    cfg = dataclasses.replace(cfg, name=meta.get("name", cfg.name),
                              region=dataclasses.replace(cfg.region, has_ln=bool(meta.get("region_ln"))))
    stored_fp8 = bool(meta.get("fp8_experts"))
    if fp8_experts is not None and fp8_experts != stored_fp8:
        raise CheckpointError(
            f"{path}: converted with fp8_experts={stored_fp8}; convert again to change expert precision")
    stored_dtype = _DTYPES.get(meta.get("dtype", "bfloat16"), jnp.bfloat16)
    model = abstract_model(cfg, dtype=stored_dtype, fp8_experts=stored_fp8)
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in _flat_params(model).items()}
    _, flat = restore_converted(path, target=target)
    if set(flat) != set(target):
        raise CheckpointError(f"{path}: converted checkpoint does not match the model's parameters")
    return _assign_flat(abstract_model(cfg, dtype=dtype, fp8_experts=stored_fp8), flat)


def _assign_flat(model: MoondreamModel, flat: dict[str, Any]) -> MoondreamModel:
    graphdef, state = nnx.split(model)
    items = []
    for path, var in nnx.to_flat_state(state):
        key = ".".join(map(str, path))
        spec = var.get_value()
        var.set_value(jnp.asarray(flat[key]).astype(spec.dtype))
        items.append((path, var))
    return nnx.merge(graphdef, nnx.from_flat_state(items))


def convert_checkpoint(src: str | Path, dst: str | Path, *, fp8_experts: bool | None = None,
                       dtype: jnp.dtype = jnp.bfloat16, overwrite: bool = False,
                       progress: bool = True) -> dict[str, float]:
    """HF safetensors -> converted (orbax) checkpoint. Returns timings in seconds."""
    t0 = time.perf_counter()
    model = load_model(src, dtype=dtype, fp8_experts=fp8_experts, progress=progress)
    t1 = time.perf_counter()
    save_converted(dst, _converted_meta(model.cfg, dtype, model.fp8_experts), _flat_params(model),
                   overwrite=overwrite)
    t2 = time.perf_counter()
    return {"load_s": t1 - t0, "save_s": t2 - t1}
