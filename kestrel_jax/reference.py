"""Skills (query, caption, detect, point, segment) on the single-request reference path.

This is the synchronous, one-request-at-a-time API that the CLI uses until the serving engine
exists, and the oracle the engine's outputs are compared with. Prompts follow MOONDREAM.md §6,
decode loops §7.4 and §9.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from kestrel_jax.generate import GenerationError, ReferenceGenerator, Sampler, SamplingSettings
from kestrel_jax.models.image_crops import ImageInput, load_image, overlap_crops
from kestrel_jax.models.loader import load_model
from kestrel_jax.models.moondream import MoondreamModel
from kestrel_jax.prompts import (
    Prompt,
    caption_prompt,
    default_query_reasoning,
    detect_prompt,
    point_prompt,
    query_prompt,
    segment_prompt,
)
from kestrel_jax.segment import segment_output
from kestrel_jax.tokenizer import Tokenizer


@dataclass
class SkillResult:
    output: Any
    finish_reason: str
    tokens: list[int] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EncodedImage:
    tokens: jax.Array  # [729, D]
    tiling: tuple[int, int]
    n_crops: int


class ReferenceMoondream:
    """Moondream on the reference path: one request at a time, exact skill semantics."""

    def __init__(self, model: MoondreamModel, tokenizer: Tokenizer, *, page_size: int = 64,
                 max_len: int | None = None):
        self.model = model
        self.cfg = model.cfg
        self.tokenizer = tokenizer
        self.gen = ReferenceGenerator(model, page_size=page_size, max_len=max_len)

    @classmethod
    def from_checkpoint(cls, path: str | Path, *, dtype: jnp.dtype = jnp.bfloat16,
                        fp8_experts: bool | None = None, progress: bool = True) -> ReferenceMoondream:
        model = load_model(path, dtype=dtype, fp8_experts=fp8_experts, progress=progress)
        return cls(model, Tokenizer.from_dir(path))

    # ------------------------------------------------------------------------------------------
    def encode_image(self, image: ImageInput) -> EncodedImage:
        crops, tiling = overlap_crops(load_image(image), self.cfg.vision)
        tokens = self.gen.encode_image_crops(crops, tiling)
        return EncodedImage(tokens, (int(tiling[0]), int(tiling[1])), int(crops.shape[0]))

    def _start(self, image: ImageInput | EncodedImage | None, prompt: Prompt) -> tuple[Any, Any, dict[str, float]]:
        t0 = time.perf_counter()
        seq = self.gen.new_sequence()
        if image is None:  # text only: BOS then the prompt, plain causal mask
            ids = [self.cfg.tokenizer.bos_id, *prompt.ids]
            slots_c = [(i + 1, v) for i, v in prompt.coord_slots]
            slots_s = [(i + 1, v) for i, v in prompt.size_slots]
            first = self.gen.feed(seq, self.gen.prompt_embeddings(ids, slots_c, slots_s))
        else:
            enc = image if isinstance(image, EncodedImage) else self.encode_image(image)
            self.gen.prefill_image(seq, enc.tokens)
            first = self.gen.feed(seq, self.gen.prompt_embeddings(prompt.ids, prompt.coord_slots,
                                                                  prompt.size_slots))
        return seq, first, {"prefill_s": time.perf_counter() - t0}

    def caption(self, image: ImageInput | EncodedImage, length: str = "normal",
                settings: SamplingSettings | None = None) -> SkillResult:
        s = (settings or SamplingSettings(temperature=0.2, top_p=0.9)).validate()
        seq, first, metrics = self._start(image, caption_prompt(self.cfg, length))
        return self._text(seq, first, s, metrics)

    def query(self, image: ImageInput | EncodedImage | None, question: str, *, reasoning: bool | None = None,
              settings: SamplingSettings | None = None, spatial_refs: tuple[Any, ...] = ()) -> SkillResult:
        s = (settings or SamplingSettings(temperature=0.2, top_p=0.9)).validate()
        reasoning = default_query_reasoning(self.cfg) if reasoning is None else reasoning
        prompt = query_prompt(self.cfg, self.tokenizer.encode, question, reasoning=reasoning,
                              spatial_refs=spatial_refs)
        seq, first, metrics = self._start(image, prompt)
        if not reasoning:
            return self._text(seq, first, s, metrics)
        t0 = time.perf_counter()
        sampler = Sampler(s)
        rids, points, _ = self.gen.reasoning_loop(seq, first, s, sampler)
        ans_first = self.gen.feed(seq, self.gen.embed_ids([self.cfg.tokenizer.answer_id]))
        result = self._text(seq, ans_first, s, metrics, sampler=sampler)
        result.metrics["reasoning_s"] = time.perf_counter() - t0 - result.metrics["decode_s"]
        result.extra["reasoning"] = {"text": self.tokenizer.decode(rids), "tokens": rids, "grounding": points}
        return result

    def detect(self, image: ImageInput | EncodedImage, obj: str, *, max_objects: int | None = None) -> SkillResult:
        return self._region(image, detect_prompt(self.cfg, self.tokenizer.encode, obj), True, max_objects)

    def point(self, image: ImageInput | EncodedImage, obj: str, *, max_objects: int | None = None,
              spatial_refs: tuple[Any, ...] = ()) -> SkillResult:
        prompt = point_prompt(self.cfg, self.tokenizer.encode, obj, spatial_refs=spatial_refs)
        return self._region(image, prompt, False, max_objects)

    def segment(self, image: ImageInput | EncodedImage, obj: str, *, settings: SamplingSettings | None = None,
                spatial_refs: tuple[Any, ...] = ()) -> SkillResult:
        """The object's outline (MD3 family): output as the engine's, `{"segments": [...]}`."""
        s = (settings or SamplingSettings()).validate()
        prompt = segment_prompt(self.cfg, self.tokenizer.encode, obj, spatial_refs=spatial_refs)
        seq, first, metrics = self._start(image, prompt)
        t0 = time.perf_counter()
        ids, coords, sizes, reason = self.gen.segment_loop(seq, first, s, Sampler(s))
        metrics["decode_s"] = time.perf_counter() - t0
        return SkillResult(segment_output(obj, ids, coords, sizes, self.tokenizer.decode), reason, ids, metrics)

    # ------------------------------------------------------------------------------------------
    def _text(self, seq: Any, first: Any, s: SamplingSettings, metrics: dict[str, float],
              sampler: Sampler | None = None) -> SkillResult:
        tk = self.cfg.tokenizer
        t0 = time.perf_counter()
        ids, reason, _ = self.gen.decode_text(seq, first, s, stop_ids=[tk.eos_id], suppress=[tk.answer_id],
                                              sampler=sampler)
        metrics["decode_s"] = time.perf_counter() - t0
        metrics["tokens_per_s"] = len(ids) / max(metrics["decode_s"], 1e-9)
        return SkillResult(self.tokenizer.decode(ids), reason, ids, metrics)

    def _region(self, image: ImageInput | EncodedImage, prompt: Prompt, boxes: bool,
                max_objects: int | None) -> SkillResult:
        limit = self.cfg.default_max_objects if max_objects is None else max_objects
        if limit < 1:
            raise GenerationError(f"max_objects must be >= 1, got {limit}")
        seq, first, metrics = self._start(image, prompt)
        t0 = time.perf_counter()
        objects, trace = self.gen.region_loop(seq, first, boxes=boxes, max_objects=limit, clamp_boxes=True)
        metrics["decode_s"] = time.perf_counter() - t0
        reason = "stop" if trace["next_tok"] and trace["next_tok"][-1] == self.cfg.tokenizer.eos_id else "length"
        if not objects:
            reason = "stop"
        return SkillResult(objects, reason, [], metrics)


def settings_with(s: SamplingSettings, **kw: Any) -> SamplingSettings:
    return dataclasses.replace(s, **kw)
