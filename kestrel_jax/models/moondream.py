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
