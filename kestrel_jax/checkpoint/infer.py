"""Infer a checkpoint's MoondreamConfig from config.json and its tensor shapes.

Every dimension the shapes determine is read off them; config.json supplies what shapes cannot
(head counts where no tensor reveals them, context length, top-k, token ids, templates), and the
family preset fills whatever both leave open. A value that config.json states and the shapes
contradict is an error naming the key, the file and the tensor.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kestrel_jax.checkpoint.spec import CheckpointError
from kestrel_jax.models.config import ConfigError, Family, MoondreamConfig, config_from_dict

Shape = tuple[int, ...]

# Keys that change the model's function and that no tensor shape determines. If config.json
# is silent on one of them, its value is an assumption and is reported as such.
_UNDETERMINED = (
    ("vision", "enc_n_heads"), ("vision", "max_crops"), ("vision", "overlap_margin"),
    ("text", "max_context"), ("text", "n_heads"), ("text", "moe", "experts_per_token"),
)
# Moondream's text head width in every released and test model (MOONDREAM.md §2.2, golden
# README); used to derive n_heads for MD2 when config.json does not give it.
TEXT_HEAD_DIM = 64


@dataclass(frozen=True)
class Fact:
    key: tuple[str, ...]  # e.g. ("text", "moe", "start_layer")
    value: int
    evidence: str  # which tensor shows it, for error messages


def config_sections(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The `config` sub-dict of a config.json (or the dict itself if it has none)."""
    inner = raw.get("config")
    return copy.deepcopy(dict(inner if isinstance(inner, Mapping) else raw))


def _get(d: Mapping[str, Any], key: tuple[str, ...]) -> Any:
    for k in key:
        if not isinstance(d, Mapping) or k not in d:
            return None
        d = d[k]
    return d


def _set(d: dict[str, Any], key: tuple[str, ...], value: Any) -> None:
    for k in key[:-1]:
        if not isinstance(d.get(k), dict):
            d[k] = dict(d.get(k) or {})
        d = d[k]
    d[key[-1]] = value


def family_hint(raw: Mapping[str, Any]) -> Family | None:
    """The family config.json states, if it states one."""
    hint = f"{raw.get('moondream_family', '')} {raw.get('model_type', '')}".lower()
    if "moondream3" in hint or _get(config_sections(raw), ("text", "moe")):
        return "md3"
    if "moondream2" in hint:
        return "md2"
    return None


def _layers(shapes: Mapping[str, Shape], prefix: str) -> list[int]:
    rx = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.")
    return sorted({int(m.group(1)) for n in shapes if (m := rx.match(n))})


def shape_facts(shapes: Mapping[str, Shape], describe: Callable[[str], str], family: Family,
                in_channels: int, text_n_heads: int | None) -> list[Fact]:
    """Dimensions read off tensor shapes. Tensors of an unexpected rank give no fact (the
    validator reports them)."""
    facts: list[Fact] = []

    def dim(key: tuple[str, ...], name: str, axis: int, rank: int, fn: Callable[[int], int | None] = int,
            ) -> int | None:
        s = shapes.get(name)
        if s is None or len(s) != rank:
            return None
        value = fn(s[axis])
        if value is not None:
            facts.append(Fact(key, value, describe(name)))
        return value

    def exact_sqrt(x: int) -> int | None:
        r = math.isqrt(x)
        return r if r * r == x else None

    # Vision.
    dim(("vision", "enc_dim"), "vision.patch_emb.weight", 0, 2)
    patch = dim(("vision", "enc_patch_size"), "vision.patch_emb.weight", 1, 2,
                lambda pd: exact_sqrt(pd // in_channels) if pd % in_channels == 0 else None)
    pos = shapes.get("vision.pos_emb")
    if pos is not None and len(pos) == 3 and (grid := exact_sqrt(pos[1])) is not None:
        facts.append(Fact(("text", "prefix_attn"), 1 + pos[1], describe("vision.pos_emb")))
        if patch is not None:
            facts.append(Fact(("vision", "crop_size"), grid * patch, describe("vision.pos_emb")))
    if vis_layers := _layers(shapes, "vision.blocks"):
        last = vis_layers[-1]
        facts.append(Fact(("vision", "enc_n_layers"), last + 1,
                          describe(_any_of(shapes, f"vision.blocks.{last}."))))
    dim(("vision", "enc_ff_dim"), "vision.blocks.0.mlp.fc1.weight", 0, 2)
    dim(("vision", "proj_inner_dim"), "vision.proj_mlp.fc1.weight", 0, 2)
    dim(("vision", "proj_out_dim"), "vision.proj_mlp.fc2.weight", 0, 2)

    # Text.
    dim(("text", "vocab_size"), "text.wte", 0, 2)
    d_model = dim(("text", "dim"), "text.wte", 1, 2)
    txt_layers = _layers(shapes, "text.blocks")
    if txt_layers:
        last = txt_layers[-1]
        facts.append(Fact(("text", "n_layers"), last + 1, describe(_any_of(shapes, f"text.blocks.{last}."))))
    if family == "md3":
        for i in txt_layers:
            if (h := dim(("text", "n_heads"), f"text.blocks.{i}.attn.tau.wq", 0, 2)) is not None:
                text_n_heads = h
                break
    if d_model is not None and text_n_heads and d_model % text_n_heads == 0:
        head_dim = d_model // text_n_heads
        for i in txt_layers:
            qkv = f"text.blocks.{i}.attn.qkv.weight"
            if qkv in shapes and len(shapes[qkv]) == 2:
                kv2 = shapes[qkv][0] - d_model
                if kv2 > 0 and kv2 % (2 * head_dim) == 0:
                    facts.append(Fact(("text", "n_kv_heads"), kv2 // (2 * head_dim), describe(qkv)))
                break
    moe_layers = [i for i in txt_layers if _is_moe_layer(shapes, i)]
    dense = [i for i in txt_layers if i not in moe_layers]
    for i in dense:
        if dim(("text", "ff_dim"), f"text.blocks.{i}.mlp.fc1.weight", 0, 2) is not None:
            break
    if family == "md3" and txt_layers:
        if moe_layers:
            first = moe_layers[0]
            facts.append(Fact(("text", "moe", "start_layer"), first,
                              describe(_any_of(shapes, f"text.blocks.{first}.mlp."))))
            dim(("text", "moe", "num_experts"), f"text.blocks.{first}.mlp.fc1.weight", 0, 3)
            dim(("text", "moe", "expert_inner_dim"), f"text.blocks.{first}.mlp.fc1.weight", 1, 3,
                lambda two_i: two_i // 2 if two_i % 2 == 0 else None)
        else:
            facts.append(Fact(("text", "moe", "start_layer"), txt_layers[-1] + 1,
                              "the absence of MoE tensors (router / 3-D fc1) in every layer"))

    # Region.
    dim(("region", "dim"), "region.coord_encoder.weight", 0, 2)
    dim(("region", "coord_feat_dim"), "region.coord_encoder.weight", 1, 2)
    dim(("region", "size_feat_dim"), "region.size_encoder.weight", 1, 2)
    if family == "md2":
        dim(("region", "inner_dim"), "region.coord_decoder.fc1.weight", 0, 2)
        dim(("region", "coord_out_dim"), "region.coord_decoder.fc2.weight", 0, 2)
        dim(("region", "size_out_dim"), "region.size_decoder.fc2.weight", 0, 2)
    else:
        dim(("region", "coord_out_dim"), "region.coord_decoder.weight", 0, 2)
        dim(("region", "size_out_dim"), "region.size_decoder.weight", 0, 2)
    return facts


def _is_moe_layer(shapes: Mapping[str, Shape], i: int) -> bool:
    b = f"text.blocks.{i}.mlp"
    return (f"{b}.router.weight" in shapes or f"{b}.router.bias" in shapes
            or len(shapes.get(f"{b}.fc1.weight", ())) == 3 or len(shapes.get(f"{b}.fc2.weight", ())) == 3)


def _any_of(shapes: Mapping[str, Shape], prefix: str) -> str:
    return next(n for n in sorted(shapes) if n.startswith(prefix))


def infer_config(raw: Mapping[str, Any], config_path: str, shapes: Mapping[str, Shape],
                 describe: Callable[[str], str], family: Family, region_ln: bool,
                 ) -> tuple[MoondreamConfig, tuple[str, ...]]:
    """(config, assumed keys). `shapes`: canonical name -> shape; `describe(name)` -> text
    naming the tensor, its stored name, shape and file."""
    sections = config_sections(raw)
    stated = family_hint(raw)
    if stated is not None and stated != family:
        evidence = ("tau tensors (text.blocks.*.attn.tau.*)" if family == "md3"
                    else "no tau tensors (text.blocks.*.attn.tau.*)")
        raise CheckpointError(
            f"config.json ({config_path}) describes a {stated} model, but the checkpoint has {evidence}, "
            f"i.e. it is {family}"
        )
    in_channels = _get(sections, ("vision", "in_channels")) or 3
    n_heads = _get(sections, ("text", "n_heads"))
    if n_heads is None and family == "md2" and "text.wte" in shapes and len(shapes["text.wte"]) == 2:
        n_heads = max(1, shapes["text.wte"][1] // TEXT_HEAD_DIM)
        _set(sections, ("text", "n_heads"), n_heads)
    facts = shape_facts(shapes, describe, family, int(in_channels), n_heads)
    determined = set()
    for fact in facts:
        said = _get(sections, fact.key)
        if said is not None and said != fact.value:
            raise CheckpointError(
                f"config.json ({config_path}) sets {'.'.join(fact.key)} = {said}, but "
                f"{fact.evidence} implies {fact.value}"
            )
        _set(sections, fact.key, fact.value)
        determined.add(fact.key)
    if family == "md3" and isinstance(sections.get("region"), dict):
        # MD3 decoders are single Linears whatever config.json says about an MLP width.
        sections["region"].pop("inner_dim", None)
    assumed = tuple(".".join(k) for k in _UNDETERMINED
                    if k not in determined and _get(config_sections(raw), k) is None
                    and (k[1] != "moe" or family == "md3"))
    outer = {k: raw[k] for k in ("moondream_family", "model_type") if k in raw}
    try:
        cfg = config_from_dict({**outer, "config": sections}, family=family)
        cfg = dataclasses.replace(cfg, region=dataclasses.replace(cfg.region, has_ln=region_ln)).validate()
    except (ConfigError, TypeError, ValueError) as e:
        hint = ("" if _get(config_sections(raw), ("tokenizer", "templates")) else
                " (config.json gives no tokenizer templates, so the family preset's were used;"
                " add a `config.tokenizer` section that fits this vocabulary)")
        raise CheckpointError(f"config inferred from config.json ({config_path}) and tensor shapes "
                              f"is inconsistent: {e}{hint}") from e
    return cfg, assumed
