"""Stored tensor names <-> canonical names, for the HF layout and Kestrel's internal layout.

HF layout: `model.` + canonical name (MOONDREAM.md §8.1/8.2). Internal layout: older MD2
revisions, Kestrel's MD3 checkpoints and MD3.1 (§8.3), e.g. `text_model.transformer.h.3.mixer.Wqkv.weight`.
Two internal tensors need more than a rename, and the reader handles them here:
- `h.{i}.tau_wqwv` [2H, qkv] holds tau.wq (rows 0..H-1) and tau.wv (rows H..2H-1);
- the Fourier frequency matrices are stored transposed ([128, 1] / [256, 2]).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Layout = Literal["hf", "internal"]

_VIS = "vision_encoder.encoder.model.visual"
_TXT = "text_model.transformer"

# (canonical template, internal template, expert-tensor condition). `{i}` is a layer index and
# `{s}` is weight|bias. The condition disambiguates canonical `mlp.fc1.weight`, which is a dense
# Linear (internal `mlp.fc1.weight`) or a 3-D expert stack (internal `mlp.experts.weight`).
_TABLE: tuple[tuple[str, str, bool | None], ...] = (
    ("vision.patch_emb.{s}", f"{_VIS}.patch_embed.linear.{{s}}", None),
    ("vision.pos_emb", f"{_VIS}.pos_embed", None),
    ("vision.blocks.{i}.ln1.{s}", f"{_VIS}.blocks.{{i}}.norm1.{{s}}", None),
    ("vision.blocks.{i}.ln2.{s}", f"{_VIS}.blocks.{{i}}.norm2.{{s}}", None),
    ("vision.blocks.{i}.attn.qkv.{s}", f"{_VIS}.blocks.{{i}}.attn.qkv.{{s}}", None),
    ("vision.blocks.{i}.attn.proj.{s}", f"{_VIS}.blocks.{{i}}.attn.proj.{{s}}", None),
    ("vision.blocks.{i}.mlp.fc1.{s}", f"{_VIS}.blocks.{{i}}.mlp.fc1.{{s}}", None),
    ("vision.blocks.{i}.mlp.fc2.{s}", f"{_VIS}.blocks.{{i}}.mlp.fc2.{{s}}", None),
    ("vision.post_ln.{s}", f"{_VIS}.norm.{{s}}", None),
    ("vision.proj_mlp.fc1.{s}", "vision_encoder.projection.mlp.fc1.{s}", None),
    ("vision.proj_mlp.fc2.{s}", "vision_encoder.projection.mlp.fc2.{s}", None),
    ("text.wte", f"{_TXT}.embd.wte.weight", None),
    ("text.blocks.{i}.ln.{s}", f"{_TXT}.h.{{i}}.ln.{{s}}", None),
    ("text.blocks.{i}.attn.qkv.{s}", f"{_TXT}.h.{{i}}.mixer.Wqkv.{{s}}", None),
    ("text.blocks.{i}.attn.proj.{s}", f"{_TXT}.h.{{i}}.mixer.out_proj.{{s}}", None),
    ("text.blocks.{i}.attn.tau.wq", f"{_TXT}.h.{{i}}.tau_wq", None),
    ("text.blocks.{i}.attn.tau.wv", f"{_TXT}.h.{{i}}.tau_wv", None),
    ("text.blocks.{i}.attn.tau.alpha", f"{_TXT}.h.{{i}}.tau_alpha", None),
    ("text.blocks.{i}.attn.k_scale", f"{_TXT}.h.{{i}}.kv_quantizer.k_scale", None),
    ("text.blocks.{i}.attn.v_scale", f"{_TXT}.h.{{i}}.kv_quantizer.v_scale", None),
    ("text.blocks.{i}.mlp.router.{s}", f"{_TXT}.h.{{i}}.gate.{{s}}", None),
    ("text.blocks.{i}.mlp.fc1.weight", f"{_TXT}.h.{{i}}.mlp.experts.weight", True),
    ("text.blocks.{i}.mlp.fc2.weight", f"{_TXT}.h.{{i}}.mlp.output_experts.weight", True),
    ("text.blocks.{i}.mlp.fc1.scale", f"{_TXT}.h.{{i}}.moe_quant.up_scale", None),
    ("text.blocks.{i}.mlp.fc2.scale", f"{_TXT}.h.{{i}}.moe_quant.down_scale", None),
    ("text.blocks.{i}.mlp.fc1.{s}", f"{_TXT}.h.{{i}}.mlp.fc1.{{s}}", False),
    ("text.blocks.{i}.mlp.fc2.{s}", f"{_TXT}.h.{{i}}.mlp.fc2.{{s}}", False),
    ("text.post_ln.{s}", "text_model.lm_head.ln.{s}", None),
    ("text.lm_head.{s}", "text_model.lm_head.linear.{s}", None),
    ("region.coord_features", "region_model.coordinate_features.weight", None),
    ("region.size_features", "region_model.size_features.weight", None),
    ("region.coord_encoder.{s}", "region_model.coordinate_encoder.{s}", None),
    ("region.size_encoder.{s}", "region_model.size_encoder.{s}", None),
    ("region.coord_decoder.fc1.{s}", "region_model.coordinate_decoder.fc1.{s}", None),
    ("region.coord_decoder.fc2.{s}", "region_model.coordinate_decoder.fc2.{s}", None),
    ("region.size_decoder.fc1.{s}", "region_model.size_decoder.fc1.{s}", None),
    ("region.size_decoder.fc2.{s}", "region_model.size_decoder.fc2.{s}", None),
    ("region.coord_decoder.{s}", "region_model.coordinate_head.{s}", None),
    ("region.size_decoder.{s}", "region_model.size_head.{s}", None),
    ("region.ln.{s}", "region_model.ln.{s}", None),
)

_TAU_WQWV = re.compile(rf"^{re.escape(_TXT)}\.h\.(?P<i>\d+)\.tau_wqwv$")
TAU_PAIR = ("attn.tau.wq", "attn.tau.wv")

# Non-persistent buffers some exporters still write (KV cache, rotary tables, masks).
_IGNORABLE = re.compile(r"(^|\.)(kv_cache|k_cache|v_cache|freqs_cis|inv_freq|attn_mask|causal_mask)(\.|$)")
_CANONICAL_ROOTS = ("vision.", "text.", "region.")
FOURIER_FEATURES = ("region.coord_features", "region.size_features")


def _to_regex(template: str) -> re.Pattern[str]:
    rx = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{s\}", r"(?P<s>weight|bias)")
    return re.compile(f"^{rx}$")


_INTERNAL_TO_CANONICAL = tuple((_to_regex(internal), canon) for canon, internal, _ in _TABLE)
_CANONICAL_TO_INTERNAL = tuple((_to_regex(canon), internal, cond) for canon, internal, cond in _TABLE)


@dataclass(frozen=True)
class NameMatch:
    """Where a stored tensor goes: one canonical name, or (tau_wqwv) a row split into two."""

    canonical: tuple[str, ...]
    row_split: bool = False  # canonical[0] <- first half of the rows, canonical[1] <- second half


def strip_orig_mod(name: str) -> str:
    """Drop the `_orig_mod` components torch.compile inserts into module paths."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def is_ignorable(stored_name: str) -> bool:
    return _IGNORABLE.search(stored_name) is not None


def canonical_of(stored_name: str) -> NameMatch:
    """Map a stored name (either layout) to canonical. Unknown names map to themselves
    (after stripping `model.`), so the validator reports them as unexpected tensors."""
    name = strip_orig_mod(stored_name)
    if name.startswith("model.") and name[len("model."):].startswith(_CANONICAL_ROOTS):
        return NameMatch((name[len("model."):],))
    if name.startswith(_CANONICAL_ROOTS):
        return NameMatch((name,))
    m = _TAU_WQWV.match(name)
    if m:
        base = f"text.blocks.{m['i']}"
        return NameMatch((f"{base}.{TAU_PAIR[0]}", f"{base}.{TAU_PAIR[1]}"), row_split=True)
    for rx, canon in _INTERNAL_TO_CANONICAL:
        m = rx.match(name)
        if m:
            return NameMatch((canon.format(**m.groupdict()),))
    return NameMatch((name,))


def tau_wqwv_name(layer: int) -> str:
    return f"{_TXT}.h.{layer}.tau_wqwv"


def stored_name_of(canonical: str, layout: Layout, *, expert: bool = False) -> str:
    """The stored name of a canonical tensor. `expert`: the tensor is a 3-D MoE expert stack."""
    if layout == "hf":
        return f"model.{canonical}"
    for rx, internal, cond in _CANONICAL_TO_INTERNAL:
        m = rx.match(canonical)
        if m and (cond is None or cond == expert):
            return internal.format(**m.groupdict())
    raise KeyError(f"no internal-layout name for canonical tensor {canonical!r}")
