"""Canonical checkpoint tensors -> model state.

Canonical names are the HF names without the leading `model.` (see `kestrel_jax.checkpoint`).
Because `MoondreamModel`'s attribute paths mirror them, the mapping is mechanical:

    <path>.weight   -> <path>.kernel (2-D Linear, transposed to [in, out])
                       <path>.scale  (LayerNorm)
                       <path>        (any other parameter stored under `.weight`, e.g. MoE experts)
    <path>.bias     -> <path>.bias
    <path>.scale    -> <parent>.<last>_scale  (FP8 expert scales: mlp.fc1.scale -> mlp.fc1_scale)
    <path>          -> <path>        (wte, pos_emb, tau.wq, region.coord_features, ...)
    text.blocks.i.attn.{k,v}_scale  -> text.kv_scales[i, 0|1]
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kestrel_jax.models.moondream import MoondreamModel, abstract_model

Path = tuple[Any, ...]


class WeightMappingError(ValueError):
    """A checkpoint tensor has no place in the model, or does not fit it."""


def _split(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in name.split(".")]


def target_path(name: str, params: dict[Path, Any]) -> tuple[Path, bool]:
    """Canonical tensor name -> (state path, transpose?)."""
    parts = _split(name)
    last, base = parts[-1], tuple(parts[:-1])
    if last == "weight":
        if base + ("kernel",) in params:
            return base + ("kernel",), True
        if base + ("scale",) in params:
            return base + ("scale",), False
        if base in params:
            return base, False
    elif last == "bias" and base + ("bias",) in params:
        return base + ("bias",), False
    elif last == "scale" and base[:-1] + (f"{base[-1]}_scale",) in params:
        return base[:-1] + (f"{base[-1]}_scale",), False
    elif tuple(parts) in params:
        return tuple(parts), False
    raise WeightMappingError(f"checkpoint tensor {name!r} has no matching model parameter")


def _is_kv_scale(name: str) -> tuple[int, int] | None:
    parts = name.split(".")
    if len(parts) == 5 and parts[:2] == ["text", "blocks"] and parts[3] == "attn" and \
            parts[4] in ("k_scale", "v_scale"):
        return int(parts[2]), 0 if parts[4] == "k_scale" else 1
    return None


def load_into_model(
    model_abstract: MoondreamModel,
    tensors: Iterable[tuple[str, np.ndarray]],
    *,
    device: jax.Device | jax.sharding.Sharding | None = None,
) -> MoondreamModel:
    """Fill an abstract model (from `abstract_model`) with checkpoint tensors, one at a time.

    Every tensor is cast to its parameter's dtype (bf16/f32, e4m3 experts kept as e4m3) and put on
    the device as it arrives, so host memory holds ~one tensor. Every parameter must be assigned
    exactly once; otherwise nothing is returned.
    """
    graphdef, state = nnx.split(model_abstract)
    flat = dict(nnx.to_flat_state(state))
    targets: dict[Path, Any] = {p: v for p, v in flat.items()}
    filled: dict[Path, jax.Array] = {}
    kv_scales = np.ones(targets[("text", "kv_scales")].get_value().shape, np.float32)
    for name, arr in tensors:
        kv = _is_kv_scale(name)
        if kv is not None:
            kv_scales[kv] = float(np.asarray(arr, np.float32).reshape(()))
            continue
        path, transpose = target_path(name, targets)
        spec = targets[path].get_value()
        a = np.asarray(arr)
        if transpose:
            a = a.T
        if tuple(a.shape) != tuple(spec.shape):
            raise WeightMappingError(
                f"tensor {name!r}: shape {tuple(arr.shape)} does not fit parameter "
                f"{'.'.join(map(str, path))} of shape {tuple(spec.shape)}"
            )
        if path in filled:
            raise WeightMappingError(f"tensor {name!r} assigned twice")
        if jnp.dtype(spec.dtype) == jnp.dtype(jnp.float8_e4m3fn) and a.dtype != spec.dtype:
            raise WeightMappingError(f"tensor {name!r}: expected float8_e4m3fn experts, got {a.dtype}")
        filled[path] = jax.device_put(a.astype(spec.dtype), device)
    filled[("text", "kv_scales")] = jax.device_put(kv_scales, device)
    missing = [".".join(map(str, p)) for p in targets if p not in filled]
    if missing:
        raise WeightMappingError(f"checkpoint is missing {len(missing)} parameters, e.g. {missing[:5]}")
    for path, var in targets.items():
        var.set_value(filled[path])
    new_state = nnx.from_flat_state(list(targets.items()))
    return nnx.merge(graphdef, new_state)


def model_from_tensors(cfg: Any, tensors: Iterable[tuple[str, np.ndarray]], *, dtype: jnp.dtype = jnp.bfloat16,
                       fp8_experts: bool = False) -> MoondreamModel:
    return load_into_model(abstract_model(cfg, dtype=dtype, fp8_experts=fp8_experts), tensors)
