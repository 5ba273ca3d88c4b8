"""Model configuration: frozen dataclasses for Moondream 2 / 3 and small test sizes.

The dimensions of a checkpoint are read from its `config.json` (`config` sub-dict, named like
the reference dataclasses) and cross-checked against its tensor shapes by the loader
(`kestrel_jax.checkpoint`). Numbers that the reference hard-codes rather than stores (rotary
theta, rotary width) are chosen by model family.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Family = Literal["md2", "md3"]


class ConfigError(ValueError):
    """A configuration value is missing, inconsistent or out of range."""


@dataclass(frozen=True)
class VisionConfig:
    enc_dim: int = 1152
    enc_patch_size: int = 14
    enc_n_layers: int = 27
    enc_ff_dim: int = 4304
    enc_n_heads: int = 16
    proj_out_dim: int = 2048
    crop_size: int = 378
    in_channels: int = 3
    max_crops: int = 12
    overlap_margin: int = 4
    proj_inner_dim: int = 8192
    # Side of the pooled/global patch grid. The reference takes it from `enc_n_layers` (27
    # for every real and test model); it must equal crop_size // enc_patch_size.
    grid_size: int = 27

    @property
    def n_patches(self) -> int:
        return self.grid_size * self.grid_size

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.enc_patch_size * self.enc_patch_size

    @property
    def head_dim(self) -> int:
        return self.enc_dim // self.enc_n_heads


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int = 64
    start_layer: int = 4
    experts_per_token: int = 8
    expert_inner_dim: int = 1024


@dataclass(frozen=True)
class TextConfig:
    dim: int = 2048
    ff_dim: int = 8192
    n_layers: int = 24
    vocab_size: int = 51200
    max_context: int = 2048
    n_heads: int = 32
    n_kv_heads: int = 32
    prefix_attn: int = 730
    rope_theta: float = 10000.0
    rotary_dim: int = 32
    tau: bool = False
    moe: MoEConfig | None = None
    ln_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def qkv_dim(self) -> int:
        return self.dim + 2 * self.n_kv_heads * self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer >= self.moe.start_layer

    @property
    def n_dense_layers(self) -> int:
        return self.n_layers if self.moe is None else min(self.moe.start_layer, self.n_layers)


@dataclass(frozen=True)
class RegionConfig:
    dim: int = 2048
    coord_feat_dim: int = 256
    coord_out_dim: int = 1024
    size_feat_dim: int = 512
    size_out_dim: int = 2048
    # MD2: coord/size decoders are 2-layer MLPs with this hidden width. MD3: None (one Linear).
    inner_dim: int | None = 8192
    # MD3 family only: a LayerNorm before the decoders, present iff the checkpoint has it.
    has_ln: bool = False


class FrozenMap(Mapping[str, tuple[int, ...]]):
    """A read-only, hashable mapping (configs are static arguments of jitted functions)."""

    def __init__(self, items: Mapping[str, tuple[int, ...]]):
        self._d = {k: tuple(int(i) for i in v) for k, v in items.items()}

    def __getitem__(self, key: str) -> tuple[int, ...]:
        return self._d[key]

    def __iter__(self) -> Any:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._d.items())))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self.items()) == dict(other.items())

    def __repr__(self) -> str:
        return f"FrozenMap({self._d!r})"


@dataclass(frozen=True)
class Templates:
    caption: Mapping[str, tuple[int, ...]] = field(
        default_factory=lambda: FrozenMap({
            "short": (1, 32708, 2, 12492, 3),
            "normal": (1, 32708, 2, 6382, 3),
            "long": (1, 32708, 2, 4059, 3),
        })
    )
    query_prefix: tuple[int, ...] = (1, 15381, 2)
    query_suffix: tuple[int, ...] = (3,)
    detect_prefix: tuple[int, ...] = (1, 7235, 476, 2)
    detect_suffix: tuple[int, ...] = (3,)
    point_prefix: tuple[int, ...] = (1, 2581, 2)
    point_suffix: tuple[int, ...] = (3,)
    # The segment skill (MOONDREAM.md §7.6): MD3-family checkpoints only; None: the model has none.
    segment_prefix: tuple[int, ...] | None = None
    segment_suffix: tuple[int, ...] | None = None

    @property
    def has_segment(self) -> bool:
        return self.segment_prefix is not None and self.segment_suffix is not None


@dataclass(frozen=True)
class TokenizerConfig:
    bos_id: int = 0
    eos_id: int = 0
    answer_id: int = 3
    thinking_id: int = 4
    coord_id: int = 5
    size_id: int = 6
    start_ground_points_id: int = 7
    end_ground_id: int = 9
    templates: Templates = field(default_factory=Templates)


@dataclass(frozen=True)
class MoondreamConfig:
    family: Family
    vision: VisionConfig = field(default_factory=VisionConfig)
    text: TextConfig = field(default_factory=TextConfig)
    region: RegionConfig = field(default_factory=RegionConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    name: str = "moondream"

    def validate(self) -> MoondreamConfig:
        v, t, r = self.vision, self.text, self.region
        if v.crop_size % v.enc_patch_size:
            raise ConfigError(f"crop_size {v.crop_size} is not a multiple of patch {v.enc_patch_size}")
        if v.crop_size // v.enc_patch_size != v.grid_size:
            raise ConfigError(
                f"patch grid {v.crop_size // v.enc_patch_size} != pooled grid {v.grid_size}"
            )
        if v.enc_dim % v.enc_n_heads:
            raise ConfigError(f"vision enc_dim {v.enc_dim} not divisible by {v.enc_n_heads} heads")
        if t.dim % t.n_heads:
            raise ConfigError(f"text dim {t.dim} not divisible by {t.n_heads} heads")
        if t.n_heads % t.n_kv_heads:
            raise ConfigError(f"n_heads {t.n_heads} not a multiple of n_kv_heads {t.n_kv_heads}")
        if t.rotary_dim > t.head_dim or t.rotary_dim % 2:
            raise ConfigError(f"rotary_dim {t.rotary_dim} invalid for head_dim {t.head_dim}")
        if v.proj_out_dim != t.dim or r.dim != t.dim:
            raise ConfigError(f"projector/region width must equal text dim {t.dim}")
        if t.prefix_attn != 1 + v.n_patches:
            raise ConfigError(f"prefix_attn {t.prefix_attn} != 1 + {v.n_patches} image tokens")
        if t.moe is not None and not (0 <= t.moe.start_layer <= t.n_layers):
            raise ConfigError(f"moe.start_layer {t.moe.start_layer} outside 0..{t.n_layers}")
        if t.moe is not None and t.moe.experts_per_token > t.moe.num_experts:
            raise ConfigError("experts_per_token exceeds num_experts")
        if r.coord_feat_dim % 2 or r.size_feat_dim % 4:
            raise ConfigError("region feature dims must be even (cos/sin halves)")
        if r.size_out_dim % 2:
            raise ConfigError("size_out_dim must hold width and height bins")
        tm = self.tokenizer.templates
        all_ids = [i for ids in tm.caption.values() for i in ids]
        for seq in (tm.query_prefix, tm.query_suffix, tm.detect_prefix, tm.detect_suffix, tm.point_prefix,
                    tm.point_suffix, tm.segment_prefix or (), tm.segment_suffix or ()):
            all_ids.extend(seq)
        tk = self.tokenizer
        all_ids.extend([tk.bos_id, tk.eos_id, tk.answer_id, tk.thinking_id, tk.coord_id, tk.size_id])
        bad = [i for i in all_ids if not 0 <= i < t.vocab_size]
        if bad:
            raise ConfigError(f"template/special token ids {sorted(set(bad))} outside vocab of {t.vocab_size}")
        return self

    @property
    def is_md3(self) -> bool:
        return self.family == "md3"

    @property
    def default_max_objects(self) -> int:
        return 150 if self.is_md3 else 50


# --------------------------------------------------------------------------------------------
# Presets


def md2_config() -> MoondreamConfig:
    return MoondreamConfig(family="md2", name="moondream2").validate()


# The MD3 family's segment template (Kestrel's; MOONDREAM.md §6.1).
MD3_SEGMENT_PREFIX, MD3_SEGMENT_SUFFIX = (1, 17374, 2), (3,)


def md3_config(*, region_ln: bool = False, name: str = "moondream3-preview") -> MoondreamConfig:
    return MoondreamConfig(
        family="md3",
        name=name,
        text=TextConfig(max_context=4096, rope_theta=1.5e6, tau=True, moe=MoEConfig()),
        region=RegionConfig(inner_dim=None, has_ln=region_ln),
        tokenizer=TokenizerConfig(templates=Templates(segment_prefix=MD3_SEGMENT_PREFIX,
                                                      segment_suffix=MD3_SEGMENT_SUFFIX)),
    ).validate()


def md3_1_config() -> MoondreamConfig:
    """Moondream 3.1 9B-A2B: the MD3 architecture with the region LayerNorm."""
    return md3_config(region_ln=True, name="moondream3.1")


def tiny_config(family: Family = "md2", *, region_ln: bool = False, vision_layers: int = 27) -> MoondreamConfig:
    """The golden-vector sizes: real structural constants, small widths. For tests.

    `vision_layers` < 27 gives a shallower vision encoder for tests that compare two paths of one
    model rather than against the golden vectors (the encoder's blocks are unrolled: its compile
    time grows with them)."""
    vision = VisionConfig(
        enc_dim=64, enc_n_layers=vision_layers, enc_ff_dim=160, enc_n_heads=4, proj_out_dim=256, proj_inner_dim=256
    )
    if family == "md2":
        text = TextConfig(dim=256, ff_dim=512, n_layers=4, vocab_size=8192, n_heads=4, n_kv_heads=4)
        region = RegionConfig(dim=256, inner_dim=256)
    else:
        text = TextConfig(
            dim=256, ff_dim=512, n_layers=4, vocab_size=8192, n_heads=4, n_kv_heads=4,
            max_context=4096, rope_theta=1.5e6, tau=True,
            moe=MoEConfig(num_experts=16, start_layer=2, experts_per_token=4, expert_inner_dim=64),
        )
        region = RegionConfig(dim=256, inner_dim=None, has_ln=region_ln)
    # Template ids must fit the small vocabulary: the golden sets' stand-ins.
    templates = Templates(
        caption=FrozenMap({"short": (1, 3270, 2, 1249, 3), "normal": (1, 3270, 2, 6382, 3),
                           "long": (1, 3270, 2, 4059, 3)}),
        query_prefix=(1, 1538, 2),
        segment_prefix=(1, 1737, 2) if family == "md3" else None,
        segment_suffix=(3,) if family == "md3" else None,
    )
    return MoondreamConfig(family=family, name=f"tiny-{family}", vision=vision, text=text, region=region,
                           tokenizer=TokenizerConfig(templates=templates)).validate()


PRESETS = {
    "moondream2": md2_config,
    "moondream3-preview": md3_config,
    "moondream3.1": md3_1_config,
}


# --------------------------------------------------------------------------------------------
# From a checkpoint's config.json


def _merge(cls: Any, base: Any, overrides: Mapping[str, Any], where: str) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in overrides.items():
        if key in names and value is not None and not isinstance(value, Mapping):
            kwargs[key] = value
        elif key not in names and key not in {"group_size", "templates", "moe"}:
            # Unknown keys are tolerated (newer checkpoints), but nothing silently changes.
            continue
    try:
        return dataclasses.replace(base, **kwargs)
    except TypeError as e:  # pragma: no cover - defensive
        raise ConfigError(f"{where}: {e}") from e


def _templates(raw: Mapping[str, Any] | None, base: Templates) -> Templates:
    if not raw:
        return base

    def ids(x: Any) -> tuple[int, ...]:
        return tuple(int(i) for i in x)

    kw: dict[str, Any] = {}
    if "caption" in raw and raw["caption"]:
        kw["caption"] = FrozenMap({k: ids(v) for k, v in raw["caption"].items()})
    for skill in ("query", "detect", "point"):
        t = raw.get(skill)
        if t:
            kw[f"{skill}_prefix"] = ids(t["prefix"])
            kw[f"{skill}_suffix"] = ids(t["suffix"])
    if "segment" in raw:  # null: the model has no segment skill
        t = raw["segment"]
        kw["segment_prefix"] = ids(t["prefix"]) if t else None
        kw["segment_suffix"] = ids(t["suffix"]) if t else None
    return dataclasses.replace(base, **kw)


def config_from_dict(raw: Mapping[str, Any], family: Family | None = None) -> MoondreamConfig:
    """Build a config from a checkpoint's config.json contents.

    `raw` may be the whole file (with a `config` sub-dict) or the sub-dict itself. Missing
    sections fall back to the family's preset. `family` overrides what the file says (the
    loader detects it from tensor names).
    """
    inner = raw.get("config", raw) if isinstance(raw.get("config", None), Mapping) else raw
    text_raw = dict(inner.get("text", {}) or {})
    if family is None:
        fam_hint = str(raw.get("moondream_family", "")) + str(raw.get("model_type", ""))
        family = "md3" if ("moondream3" in fam_hint or text_raw.get("moe")) else "md2"
    base = md3_config() if family == "md3" else md2_config()

    moe_raw = text_raw.get("moe")
    text = _merge(TextConfig, base.text, text_raw, "text")
    if family == "md3":
        moe = _merge(MoEConfig, base.text.moe or MoEConfig(), dict(moe_raw or {}), "text.moe")
        text = dataclasses.replace(text, moe=moe, tau=True)
    else:
        text = dataclasses.replace(text, moe=None, tau=False)
    vision = _merge(VisionConfig, base.vision, dict(inner.get("vision", {}) or {}), "vision")
    vision = dataclasses.replace(vision, grid_size=vision.crop_size // vision.enc_patch_size)
    region_raw = dict(inner.get("region", {}) or {})
    region = _merge(RegionConfig, base.region, region_raw, "region")
    tok_raw = dict(inner.get("tokenizer", {}) or {})
    tokenizer = _merge(TokenizerConfig, base.tokenizer, tok_raw, "tokenizer")
    templates = _templates(tok_raw.get("templates"), base.tokenizer.templates)
    seg = (*(templates.segment_prefix or ()), *(templates.segment_suffix or ()))
    if family == "md2" or any(not 0 <= i < text.vocab_size for i in seg):
        # MD2 has no segment skill; nor has a checkpoint whose vocabulary cannot hold the family's
        # template and whose config names none (a small synthetic model written before the skill)
        templates = dataclasses.replace(templates, segment_prefix=None, segment_suffix=None)
    tokenizer = dataclasses.replace(tokenizer, templates=templates)
    name = str(raw.get("moondream_family", base.name))
    cfg = MoondreamConfig(family=family, name=name, vision=vision, text=text, region=region,
                          tokenizer=tokenizer)
    return cfg.validate()


def config_to_dict(cfg: MoondreamConfig) -> dict[str, Any]:
    """Inverse of `config_from_dict` (the `config` sub-dict of a config.json)."""
    t = cfg.text
    text: dict[str, Any] = {
        "dim": t.dim, "ff_dim": t.ff_dim, "n_layers": t.n_layers, "vocab_size": t.vocab_size,
        "max_context": t.max_context, "n_heads": t.n_heads, "n_kv_heads": t.n_kv_heads,
        "prefix_attn": t.prefix_attn, "group_size": None,
    }
    if t.moe is not None:
        text["moe"] = dataclasses.asdict(t.moe)
    v = dataclasses.asdict(cfg.vision)
    v.pop("grid_size")
    region = {k: val for k, val in dataclasses.asdict(cfg.region).items() if k not in {"has_ln"}}
    if region["inner_dim"] is None:
        region.pop("inner_dim")
    tk = cfg.tokenizer
    tm = tk.templates
    tok = {
        "bos_id": tk.bos_id, "eos_id": tk.eos_id, "answer_id": tk.answer_id,
        "thinking_id": tk.thinking_id, "coord_id": tk.coord_id, "size_id": tk.size_id,
        "start_ground_points_id": tk.start_ground_points_id, "end_ground_id": tk.end_ground_id,
        "templates": {
            "caption": {k: list(ids) for k, ids in tm.caption.items()},
            "query": {"prefix": list(tm.query_prefix), "suffix": list(tm.query_suffix)},
            "detect": {"prefix": list(tm.detect_prefix), "suffix": list(tm.detect_suffix)},
            "point": {"prefix": list(tm.point_prefix), "suffix": list(tm.point_suffix)},
            "segment": ({"prefix": list(tm.segment_prefix), "suffix": list(tm.segment_suffix)}
                        if tm.segment_prefix is not None and tm.segment_suffix is not None else None),
        },
    }
    return {"text": text, "vision": v, "region": region, "tokenizer": tok}
