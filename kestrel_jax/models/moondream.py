"""The whole Moondream model: vision encoder, text decoder, region heads (Flax NNX)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kestrel_jax.models.config import MoondreamConfig
from kestrel_jax.models.region import RegionModel
from kestrel_jax.models.text import TextModel
from kestrel_jax.models.vision import VisionEncoder


class MoondreamModel(nnx.Module):
    """Attribute paths mirror the HF checkpoint's module paths (`vision.blocks.3.attn.qkv`, ...),
    so the checkpoint mapping (`weights.py`) is a near-identity: Linear `weight` -> `kernel`
    (transposed), LayerNorm `weight` -> `scale`."""

    def __init__(self, cfg: MoondreamConfig, *, dtype: jnp.dtype = jnp.bfloat16, fp8_experts: bool = False,
                 rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.cfg = cfg
        self.dtype = dtype
        self.fp8_experts = fp8_experts
        self.vision = VisionEncoder(cfg.vision, dtype=dtype, rngs=rngs)
        self.text = TextModel(cfg.text, dtype=dtype, fp8_experts=fp8_experts, rngs=rngs)
        self.region = RegionModel(cfg.region, dtype=dtype, rngs=rngs)


def abstract_model(cfg: MoondreamConfig, *, dtype: jnp.dtype = jnp.bfloat16,
                   fp8_experts: bool = False) -> MoondreamModel:
    """The model with ShapeDtypeStruct leaves: no memory, no random init."""
    return nnx.eval_shape(lambda: MoondreamModel(cfg, dtype=dtype, fp8_experts=fp8_experts,
                                                 rngs=nnx.Rngs(0)))


def count_params(model: MoondreamModel) -> int:
    """Number of checkpoint parameters (excludes the FP8 scales and KV scales)."""
    state = nnx.state(model, nnx.Param)
    total = 0
    for path, leaf in nnx.to_flat_state(state):
        if str(path[-1]).endswith("_scale"):
            continue
        total += int(np.prod(leaf.get_value().shape))
    return total


def param_bytes(model: MoondreamModel) -> int:
    state = nnx.state(model)
    return sum(int(np.prod(v.shape)) * jnp.dtype(v.dtype).itemsize
               for v in jax.tree.leaves(state))


def random_model(cfg: MoondreamConfig, *, dtype: jnp.dtype = jnp.bfloat16, fp8_experts: bool = False,
                 seed: int = 0, std: float = 0.02, suppress_ids: int = 16,
                 kv_scale: float | None = None) -> MoondreamModel:
    """A model with random weights created directly on the device (seconds, no checkpoint):
    N(0, std) weights, LayerNorm scales 1 and biases 0, the lm_head bias of ids < suppress_ids at
    -1e4 (so the model never emits EOS/control tokens and benchmarks run to max_tokens), FP8
    experts with per-row scales, optional KV scales. Same value recipe as the synthetic
    checkpoint writer; not the same values."""
    from kestrel_jax.pallas.moe import quantize_experts

    model = abstract_model(cfg, dtype=dtype, fp8_experts=fp8_experts)
    graphdef, state = nnx.split(model)
    flat = nnx.to_flat_state(state)
    key = jax.random.key(seed)
    out = []
    pending_scales: dict[tuple, jax.Array] = {}
    for i, (path, var) in enumerate(flat):
        spec = var.get_value()
        name = str(path[-1])
        k = jax.random.fold_in(key, i)
        if name == "kv_scales":
            val = jnp.full(spec.shape, kv_scale if kv_scale is not None else 1.0, jnp.float32)
        elif name.endswith("_scale"):
            val = pending_scales.pop(path[:-1] + (name[: -len("_scale")],), jnp.ones(spec.shape, spec.dtype))
        elif name == "scale":
            val = jnp.ones(spec.shape, spec.dtype)
        elif name == "bias":
            val = jnp.zeros(spec.shape, spec.dtype)
            if path[-2] == "lm_head":
                val = val.at[:suppress_ids].set(-1e4)
        elif jnp.dtype(spec.dtype) == jnp.dtype(jnp.float8_e4m3fn):
            q, s = quantize_experts(jax.random.normal(k, spec.shape, jnp.bfloat16) * std)
            pending_scales[path] = s
            val = q
        elif name in ("coord_features", "size_features", "alpha"):
            val = jax.random.normal(k, spec.shape, spec.dtype)
        else:
            val = (jax.random.normal(k, spec.shape, jnp.float32) * std).astype(spec.dtype)
        var.set_value(val)
        out.append((path, var))
    return nnx.merge(graphdef, nnx.from_flat_state(out))
