"""The tensors a Moondream checkpoint must hold, by canonical name, for any configuration.

Canonical name = the Hugging Face name without its leading `model.` (`text.wte`,
`vision.blocks.3.attn.qkv.bias`, ...). Shapes are the HF ones (PyTorch `[out, in]`); the model
does its own transposes. `expected_tensors` is the single declaration that the reader
validates against and the synthetic writer generates from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from kestrel_jax.models.config import MoondreamConfig


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed, or does not match the model it claims to be."""


# Safetensors dtype codes. Ordinary weights may be stored in any of FLOAT_DTYPES (the consumer
# casts); FP8 experts only as e4m3 (the scales define their meaning).
FLOAT_DTYPES = frozenset({"BF16", "F16", "F32"})
FP8_DTYPES = frozenset({"F8_E4M3"})

# How a tensor is initialised by the synthetic writer; the reader ignores it.
Kind = Literal[
    "weight",  # N(0, std)
    "bias",  # 0
    "ln_weight",  # 1
    "ln_bias",  # 0
    "lm_bias",  # 0, except ids < suppress_ids at -1e4
    "normal",  # N(0, 1): tau alpha, Fourier frequencies
    "fp8_weight",  # N(0, std) quantised to e4m3 per output row (scale tensor named `<base>.scale`)
    "fp8_scale",  # float32 per-output-row scale of the matching fp8_weight
    "kv_scale",  # float32 scalar
]


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtypes: frozenset[str]  # allowed safetensors dtype codes
    kind: Kind

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _w(*shape: int) -> TensorSpec:
    return TensorSpec(tuple(shape), FLOAT_DTYPES, "weight")


def _linear(out: dict[str, TensorSpec], name: str, n_out: int, n_in: int) -> None:
    out[f"{name}.weight"] = _w(n_out, n_in)
    out[f"{name}.bias"] = TensorSpec((n_out,), FLOAT_DTYPES, "bias")


def _layernorm(out: dict[str, TensorSpec], name: str, dim: int) -> None:
    out[f"{name}.weight"] = TensorSpec((dim,), FLOAT_DTYPES, "ln_weight")
    out[f"{name}.bias"] = TensorSpec((dim,), FLOAT_DTYPES, "ln_bias")


def expected_tensors(
    cfg: MoondreamConfig,
    *,
    fp8_experts: bool = False,
    kv_scales: bool = False,
    region_ln: bool | None = None,
) -> dict[str, TensorSpec]:
    """Canonical name -> spec for every tensor of `cfg`, in HF order (vision, text, region).

    fp8_experts: MoE fc1/fc2 stored as e4m3 with float32 per-output-row scales
        `text.blocks.{i}.mlp.fc{1,2}.scale` ([E, 2I] and [E, D]).
    kv_scales: per-layer scalar `text.blocks.{i}.attn.{k,v}_scale` (FP8 KV cache).
    region_ln: the MD3-family region LayerNorm `region.ln.*`; None -> `cfg.region.has_ln`.
    """
    v, t, r = cfg.vision, cfg.text, cfg.region
    if region_ln is None:
        region_ln = r.has_ln
    if fp8_experts and t.moe is None:
        raise CheckpointError(f"fp8_experts requires a MoE model; {cfg.name} ({cfg.family}) has none")
    if region_ln and cfg.family != "md3":
        raise CheckpointError(f"the region LayerNorm exists only in the MD3 family, not {cfg.family}")

    out: dict[str, TensorSpec] = {}
    # Vision encoder + projector.
    _linear(out, "vision.patch_emb", v.enc_dim, v.patch_dim)
    out["vision.pos_emb"] = _w(1, v.n_patches, v.enc_dim)
    for i in range(v.enc_n_layers):
        b = f"vision.blocks.{i}"
        _layernorm(out, f"{b}.ln1", v.enc_dim)
        _linear(out, f"{b}.attn.qkv", 3 * v.enc_dim, v.enc_dim)
        _linear(out, f"{b}.attn.proj", v.enc_dim, v.enc_dim)
        _layernorm(out, f"{b}.ln2", v.enc_dim)
        _linear(out, f"{b}.mlp.fc1", v.enc_ff_dim, v.enc_dim)
        _linear(out, f"{b}.mlp.fc2", v.enc_dim, v.enc_ff_dim)
    _layernorm(out, "vision.post_ln", v.enc_dim)
    _linear(out, "vision.proj_mlp.fc1", v.proj_inner_dim, 2 * v.enc_dim)
    _linear(out, "vision.proj_mlp.fc2", v.proj_out_dim, v.proj_inner_dim)

    # Text decoder.
    out["text.wte"] = _w(t.vocab_size, t.dim)
    for i in range(t.n_layers):
        b = f"text.blocks.{i}"
        _layernorm(out, f"{b}.ln", t.dim)
        _linear(out, f"{b}.attn.qkv", t.qkv_dim, t.dim)
        _linear(out, f"{b}.attn.proj", t.dim, t.dim)
        if t.tau:
            out[f"{b}.attn.tau.wq"] = _w(t.n_heads, t.qkv_dim)
            out[f"{b}.attn.tau.wv"] = _w(t.n_heads, t.qkv_dim)
            out[f"{b}.attn.tau.alpha"] = TensorSpec((t.n_heads,), FLOAT_DTYPES, "normal")
        if kv_scales:
            out[f"{b}.attn.k_scale"] = TensorSpec((), FLOAT_DTYPES, "kv_scale")
            out[f"{b}.attn.v_scale"] = TensorSpec((), FLOAT_DTYPES, "kv_scale")
        if t.moe is not None and t.is_moe_layer(i):
            n_exp, inner = t.moe.num_experts, t.moe.expert_inner_dim
            _linear(out, f"{b}.mlp.router", n_exp, t.dim)
            if fp8_experts:
                out[f"{b}.mlp.fc1.weight"] = TensorSpec((n_exp, 2 * inner, t.dim), FP8_DTYPES, "fp8_weight")
                out[f"{b}.mlp.fc1.scale"] = TensorSpec((n_exp, 2 * inner), FLOAT_DTYPES, "fp8_scale")
                out[f"{b}.mlp.fc2.weight"] = TensorSpec((n_exp, t.dim, inner), FP8_DTYPES, "fp8_weight")
                out[f"{b}.mlp.fc2.scale"] = TensorSpec((n_exp, t.dim), FLOAT_DTYPES, "fp8_scale")
            else:
                out[f"{b}.mlp.fc1.weight"] = _w(n_exp, 2 * inner, t.dim)
                out[f"{b}.mlp.fc2.weight"] = _w(n_exp, t.dim, inner)
        else:
            _linear(out, f"{b}.mlp.fc1", t.ff_dim, t.dim)
            _linear(out, f"{b}.mlp.fc2", t.dim, t.ff_dim)
    _layernorm(out, "text.post_ln", t.dim)
    out["text.lm_head.weight"] = _w(t.vocab_size, t.dim)
    out["text.lm_head.bias"] = TensorSpec((t.vocab_size,), FLOAT_DTYPES, "lm_bias")

    # Region model: Fourier encoders, then MLP (MD2) or single-Linear (MD3) decoders.
    out["region.coord_features"] = TensorSpec((1, r.coord_feat_dim // 2), FLOAT_DTYPES, "normal")
    _linear(out, "region.coord_encoder", r.dim, r.coord_feat_dim)
    out["region.size_features"] = TensorSpec((2, r.size_feat_dim // 2), FLOAT_DTYPES, "normal")
    _linear(out, "region.size_encoder", r.dim, r.size_feat_dim)
    if cfg.family == "md2":
        if r.inner_dim is None:
            raise CheckpointError("an MD2 config needs region.inner_dim (hidden width of the decoders)")
        _linear(out, "region.coord_decoder.fc1", r.inner_dim, r.dim)
        _linear(out, "region.coord_decoder.fc2", r.coord_out_dim, r.inner_dim)
        _linear(out, "region.size_decoder.fc1", r.inner_dim, r.dim)
        _linear(out, "region.size_decoder.fc2", r.size_out_dim, r.inner_dim)
    else:
        _linear(out, "region.coord_decoder", r.coord_out_dim, r.dim)
        _linear(out, "region.size_decoder", r.size_out_dim, r.dim)
    if region_ln:
        _layernorm(out, "region.ln", r.dim)
    return out


def parameter_count(specs: dict[str, TensorSpec], *, include_scales: bool = False) -> int:
    """Number of parameters (elements) declared by `specs`, without allocating anything."""
    return sum(
        s.numel for s in specs.values() if include_scales or s.kind not in ("fp8_scale", "kv_scale")
    )
