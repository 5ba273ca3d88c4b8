"""Prompt assembly for the Moondream skills (MOONDREAM.md §6.1-6.3, §9.3).

Every prompt is the token list prefilled right after the 730-token image prefix (BOS + 729
image embeddings); templates and special ids come from `cfg.tokenizer`, text goes through the
caller's `encode` (the reference's `tokenizer.encode(s).ids`, nothing added).

Spatial references (query, point and segment) put placeholder ids in the prompt whose embeddings the model
replaces: a point adds `[coord, coord]` (x, y); a box adds `[coord, coord, size]` (centre x,
centre y, (width, height)). `Prompt.coord_slots` / `size_slots` name those positions (indices
into `Prompt.ids`) and the values to encode there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kestrel_jax.models.config import MoondreamConfig

Encode = Callable[[str], Sequence[int]]
CaptionLength = Literal["short", "normal", "long"]
# (x, y) point or (x_min, y_min, x_max, y_max) box, normalised to [0, 1] of the image; mappings
# with keys x, y or x_min, y_min, x_max, y_max are accepted too.
SpatialRef = Sequence[float] | Mapping[str, float]


def box_from_center(x: float, y: float, w: float, h: float, *, clamp: bool = True) -> dict[str, float]:
    """A detected object's box from its centre and size (MOONDREAM.md section 7.3): centre -+ size / 2.
    The engine reports boxes clamped to [0, 1] of the image, as Kestrel does (a box may otherwise
    reach past an edge); `clamp=False` keeps the reference implementation's unclamped values (the
    golden parity checks). The model itself is fed the unclamped size either way."""
    box = {"x_min": x - w / 2, "y_min": y - h / 2, "x_max": x + w / 2, "y_max": y + h / 2}
    return {k: min(max(v, 0.0), 1.0) for k, v in box.items()} if clamp else box


class PromptError(ValueError):
    """A prompt cannot be built from the given text, options or spatial references."""


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    # (index into ids, value in [0, 1]): embedding replaced by E_coord(value).
    coord_slots: tuple[tuple[int, float], ...] = ()
    # (index into ids, (width, height)): embedding replaced by E_size(width, height).
    size_slots: tuple[tuple[int, tuple[float, float]], ...] = ()

    def __len__(self) -> int:
        return len(self.ids)


def default_query_reasoning(cfg: MoondreamConfig) -> bool:
    """MD2's `query` defaults to a direct answer, MD3's to reasoning first (§9.2)."""
    return cfg.is_md3


def caption_prompt(cfg: MoondreamConfig, length: str = "normal", *,
                   max_prompt_tokens: int | None = None) -> Prompt:
    templates = cfg.tokenizer.templates.caption
    if length not in templates:
        raise PromptError(f"unknown caption length {length!r}; choose one of {sorted(templates)}")
    return _finish(cfg, list(templates[length]), [], [], max_prompt_tokens)


def query_prompt(
    cfg: MoondreamConfig,
    encode: Encode,
    question: str,
    *,
    reasoning: bool,
    spatial_refs: Sequence[SpatialRef] = (),
    max_prompt_tokens: int | None = None,
) -> Prompt:
    """prefix + refs + enc(question) + tail, where the tail is (§6.2):

    md2: [answer, answer] without reasoning (the suffix twice, as MD2 was trained), and
    [answer, thinking] with reasoning; md3: [answer] and [thinking]. With reasoning, generation
    runs until the model samples `answer_id`; the caller then prefills `answer_id` itself.
    """
    tk = cfg.tokenizer
    tm = tk.templates
    _check_text(question, "question")
    ids = list(tm.query_prefix)
    coord_slots, size_slots = _add_refs(cfg, ids, spatial_refs)
    ids += _encoded(cfg, encode, question, "question")
    if cfg.is_md3:
        ids += [tk.thinking_id] if reasoning else list(tm.query_suffix)
    else:
        ids += list(tm.query_suffix) + ([tk.thinking_id] if reasoning else list(tm.query_suffix))
    return _finish(cfg, ids, coord_slots, size_slots, max_prompt_tokens)


def detect_prompt(cfg: MoondreamConfig, encode: Encode, obj: str, *,
                  max_prompt_tokens: int | None = None) -> Prompt:
    """prefix + enc(" " + object) + suffix (the object is encoded after a space)."""
    tm = cfg.tokenizer.templates
    return _object_prompt(cfg, encode, obj, tm.detect_prefix, tm.detect_suffix, max_prompt_tokens)


def point_prompt(cfg: MoondreamConfig, encode: Encode, obj: str, *, spatial_refs: Sequence[SpatialRef] = (),
                 max_prompt_tokens: int | None = None) -> Prompt:
    """prefix + refs + enc(" " + object) + suffix, like detect with the point template (spatial
    references as Kestrel's point takes them)."""
    tm = cfg.tokenizer.templates
    return _object_prompt(cfg, encode, obj, tm.point_prefix, tm.point_suffix, max_prompt_tokens, spatial_refs)


def has_segment(cfg: MoondreamConfig) -> bool:
    """Whether the model has the segment skill (its prompt template: the Moondream 3 family)."""
    tm = cfg.tokenizer.templates
    return tm.segment_prefix is not None and tm.segment_suffix is not None


def segment_prompt(cfg: MoondreamConfig, encode: Encode, obj: str, *, spatial_refs: Sequence[SpatialRef] = (),
                   max_prompt_tokens: int | None = None) -> Prompt:
    """prefix + refs + enc(object) + suffix (no leading space; MOONDREAM.md §6.2). MD3-family
    models only: a model without the segment template raises PromptError."""
    tm = cfg.tokenizer.templates
    if tm.segment_prefix is None or tm.segment_suffix is None:  # (has_segment, spelt out for the type checker)
        raise PromptError(f"{cfg.name} has no segment skill (the Moondream 3 family has; Moondream 2 has not)")
    _check_text(obj, "object")
    ids = list(tm.segment_prefix)
    coord_slots, size_slots = _add_refs(cfg, ids, spatial_refs)
    ids += _encoded(cfg, encode, obj, "object") + list(tm.segment_suffix)
    return _finish(cfg, ids, coord_slots, size_slots, max_prompt_tokens)


# --------------------------------------------------------------------------------------------


def _add_refs(cfg: MoondreamConfig, ids: list[int], spatial_refs: Sequence[SpatialRef],
              ) -> tuple[list[tuple[int, float]], list[tuple[int, tuple[float, float]]]]:
    """Appends the spatial references' placeholder ids to `ids`; returns their slots."""
    tk = cfg.tokenizer
    coord_slots: list[tuple[int, float]] = []
    size_slots: list[tuple[int, tuple[float, float]]] = []
    for n, ref in enumerate(spatial_refs):
        values = _ref_values(ref, n)
        if len(values) == 2:
            x, y = values
            coord_slots += [(len(ids), x), (len(ids) + 1, y)]
            ids += [tk.coord_id, tk.coord_id]
        else:
            x0, y0, x1, y1 = values
            coord_slots += [(len(ids), (x0 + x1) / 2), (len(ids) + 1, (y0 + y1) / 2)]
            size_slots.append((len(ids) + 2, (x1 - x0, y1 - y0)))
            ids += [tk.coord_id, tk.coord_id, tk.size_id]
    return coord_slots, size_slots


def _object_prompt(cfg: MoondreamConfig, encode: Encode, obj: str, prefix: Sequence[int],
                   suffix: Sequence[int], max_prompt_tokens: int | None,
                   spatial_refs: Sequence[SpatialRef] = ()) -> Prompt:
    _check_text(obj, "object")
    ids = list(prefix)
    coord_slots, size_slots = _add_refs(cfg, ids, spatial_refs)
    ids += _encoded(cfg, encode, " " + obj, "object") + list(suffix)
    return _finish(cfg, ids, coord_slots, size_slots, max_prompt_tokens)


def _check_text(text: Any, what: str) -> None:
    if not isinstance(text, str):
        raise PromptError(f"{what} must be a string, got {type(text).__name__}")
    if not text.strip():
        raise PromptError(f"{what} is empty or whitespace only")


def _encoded(cfg: MoondreamConfig, encode: Encode, text: str, what: str) -> list[int]:
    ids = [int(i) for i in encode(text)]
    vocab = cfg.text.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise PromptError(f"the tokenizer produced ids {bad[:5]} outside the model's vocabulary (size "
                          f"{vocab}) for the {what}; is it the tokenizer of this checkpoint?")
    if not ids:
        raise PromptError(f"the {what} {text!r} encodes to no tokens")
    return ids


def _ref_values(ref: SpatialRef, n: int) -> tuple[float, ...]:
    """Validated (x, y) or (x_min, y_min, x_max, y_max) of spatial reference number `n`."""
    if isinstance(ref, Mapping):
        keys = ("x", "y") if {"x", "y"} <= ref.keys() else ("x_min", "y_min", "x_max", "y_max")
        missing = [k for k in keys if k not in ref]
        if missing:
            raise PromptError(f"spatial ref {n}: a mapping needs keys x, y (point) or x_min, y_min, "
                              f"x_max, y_max (box); missing {missing}")
        raw: Sequence[Any] = [ref[k] for k in keys]
    elif isinstance(ref, Sequence) and not isinstance(ref, str | bytes):
        raw = ref
    else:
        raise PromptError(f"spatial ref {n}: expected (x, y) or (x_min, y_min, x_max, y_max), "
                          f"got {type(ref).__name__}")
    if len(raw) not in (2, 4):
        raise PromptError(f"spatial ref {n}: expected 2 values (point) or 4 (box), got {len(raw)}")
    try:
        values = tuple(float(v) for v in raw)
    except (TypeError, ValueError) as e:
        raise PromptError(f"spatial ref {n}: values must be numbers ({e})") from e
    for v in values:
        if not math.isfinite(v) or not 0.0 <= v <= 1.0:
            raise PromptError(f"spatial ref {n}: {values} must be normalised to [0, 1] of the image")
    if len(values) == 4 and (values[2] < values[0] or values[3] < values[1]):
        raise PromptError(f"spatial ref {n}: box {values} needs x_min <= x_max and y_min <= y_max")
    return values


def _finish(cfg: MoondreamConfig, ids: list[int], coord_slots: list[tuple[int, float]],
            size_slots: list[tuple[int, tuple[float, float]]], max_prompt_tokens: int | None) -> Prompt:
    # The prompt follows the image prefix, so it can never use more than the rest of the context.
    room = cfg.text.max_context - cfg.text.prefix_attn
    limit = room if max_prompt_tokens is None else min(max_prompt_tokens, room)
    if len(ids) > limit:
        raise PromptError(f"prompt is {len(ids)} tokens, above the limit of {limit} (max_prompt_tokens="
                          f"{max_prompt_tokens}, context room {room}); shorten the text")
    assert all(ids[i] == cfg.tokenizer.coord_id for i, _ in coord_slots)
    assert all(ids[i] == cfg.tokenizer.size_id for i, _ in size_slots)
    return Prompt(ids=tuple(ids), coord_slots=tuple(coord_slots), size_slots=tuple(size_slots))
