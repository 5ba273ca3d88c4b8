"""Per-request skill state machines: what a sequence feeds next, and when it is done.

A `Job` turns each step's outputs for its row (sampled token, decoded coordinate/size, region
continuation) into its next input and its results, exactly as the reference loops do
(`kestrel_jax.generate`, MOONDREAM.md §6.3, §7.4, §9):
  - text (caption, answers): sample; stop on EOS or max_tokens; the answer token is suppressed
    on decode steps (not on the first token after a prefill).
  - reasoning (query with reasoning): sample with EOS and size suppressed on decode steps; the
    answer token or max_tokens ends it, then the answer token is fed and the text phase starts;
    a sampled coordinate token feeds E_coord(value decoded from the same hidden state).
  - region (detect/point): decide -> x -> y (-> size) -> decide ...; coordinates and sizes are
    greedy bins fed back as E_coord / E_size.
  - segment (MD3 family): sample freely (greedy by default) until EOS or max_tokens; a sampled
    coordinate token feeds E_coord and a sampled size token E_size, each decoded from the hidden
    state that sampled it; every other token is path text (MOONDREAM.md §7.6, `kestrel_jax.segment`).
Pure Python; no JAX.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from kestrel_jax.models.config import MoondreamConfig
from kestrel_jax.prompts import Prompt, box_from_center
from kestrel_jax.segment import segment_output
from kestrel_jax.serving.batch import RowSpec

Skill = Literal["caption", "query", "detect", "point", "segment"]
IN_TOKEN, IN_COORD, IN_SIZE = 0, 1, 2


class SettingsError(ValueError):
    """Invalid request settings (temperature, top_p, max_tokens, ...)."""


@dataclass(frozen=True)
class Settings:
    """Kestrel-compatible request settings."""

    temperature: float = 0.2
    top_p: float = 0.9
    top_k: int = 0
    max_tokens: int = 768
    max_objects: int | None = None  # None: the model's default (MD2 50, MD3 150)
    seed: int | None = None  # None: derived from the request id
    ignore_eos: bool = False  # benchmarks: run text to max_tokens

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, *, skill: Skill) -> Settings:
        d = dict(d or {})
        unknown = set(d) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise SettingsError(f"unknown settings {sorted(unknown)}")
        if skill in ("detect", "point", "segment"):  # Kestrel's defaults: greedy
            d.setdefault("temperature", 0.0)
            d.setdefault("top_p", 1.0)
        try:
            s = cls(**d)
        except TypeError as e:
            raise SettingsError(str(e)) from e
        return s.validate(skill)

    def validate(self, skill: Skill) -> Settings:
        def num(x: Any) -> bool:
            return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)

        if not num(self.temperature) or self.temperature < 0:
            raise SettingsError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not num(self.top_p) or not 0 < self.top_p <= 1:
            raise SettingsError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise SettingsError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise SettingsError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.max_objects is not None and (not isinstance(self.max_objects, int) or self.max_objects < 1):
            raise SettingsError(f"max_objects must be an integer >= 1, got {self.max_objects!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**32):
            raise SettingsError(f"seed must be an integer in [0, 2^32), got {self.seed!r}")
        return self


@dataclass
class StepOut:
    """One row's outputs of a step (host copies)."""

    token: int
    logprob: float
    coord: float
    size: tuple[float, float]
    region_next: int


@dataclass
class Job:
    """The engine's view of one request: prompt, settings and generation state."""

    request_id: int
    skill: Skill
    cfg: MoondreamConfig
    prompt: Prompt
    settings: Settings
    reasoning: bool = False
    has_image: bool = True
    on_text: Callable[[list[int]], None] | None = None  # called with new answer tokens (streaming)
    # --- state
    phase: str = "text"
    first_of_phase: bool = True  # next sample comes right after a prefill / the answer-token feed
    next_kind: int = IN_TOKEN
    next_token: int = 0
    next_value: tuple[float, float] = (0.0, 0.0)
    samples: int = 0  # sampling step counter (seeds)
    tokens: list[int] = field(default_factory=list)
    reasoning_tokens: list[int] = field(default_factory=list)
    grounding: list[dict[str, float]] = field(default_factory=list)
    objects: list[dict[str, float]] = field(default_factory=list)
    pending_xy: list[float] = field(default_factory=list)
    coords: list[float] = field(default_factory=list)  # segment: decoded coordinates, in order
    sizes: list[tuple[float, float]] = field(default_factory=list)  # segment: decoded sizes
    subject: str = ""  # segment: the object asked for (reported with the result)
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        if self.skill in ("detect", "point"):
            self.phase = "decide"
        elif self.skill == "query" and self.reasoning:
            self.phase = "reasoning"
        elif self.skill == "segment":
            self.phase = "segment"

    # ----------------------------------------------------------------------------- budget
    @property
    def max_objects(self) -> int:
        return self.settings.max_objects or self.cfg.default_max_objects

    def step_budget(self) -> int:
        """Most outputs (prefill end + decode steps) this job can consume."""
        m = self.settings.max_tokens
        if self.skill in ("detect", "point"):
            return 1 + (3 if self.skill == "detect" else 2) * self.max_objects
        if self.phase == "reasoning":
            return 2 * m + 1
        return m

    # ----------------------------------------------------------------------------- next step
    # The engine may dispatch a step before it has read this job's previous outputs ("pending":
    # how many; more than one after a multi-step launch): then the step takes its input from the
    # last of them on the device (batch.py), and these methods describe the step as if the
    # pending outputs had been consumed.

    def can_run_ahead(self, pending: int) -> bool:
        """Whether this job's next outputs need no host decision between them: plain answer /
        caption tokens, each fed back as the next input (multi-step decode), and segment outputs
        (the device feeds a sampled coordinate / size token's decoded value itself). Reasoning and
        region phases, and the first sample of a phase, go one step at a time."""
        return self.phase in ("text", "segment") and (pending > 0 or not self.first_of_phase)

    def _forced_answer(self, pending: int) -> bool:
        """Reasoning hit max_tokens: the pending sample is discarded and the answer token fed."""
        return bool(pending) and self.phase == "reasoning" and len(self.reasoning_tokens) >= self.settings.max_tokens

    def next_input(self, pending: int) -> tuple[int, int, tuple[float, float], bool]:
        """(kind, token, value, from_previous_output) of the next step's input."""
        if not pending:
            return self.next_kind, self.next_token, self.next_value, False
        if self._forced_answer(pending):
            return IN_TOKEN, self.cfg.tokenizer.answer_id, (0.0, 0.0), False
        if self.phase in ("text", "reasoning", "segment"):
            return IN_TOKEN, 0, (0.0, 0.0), True  # the sampled token (device: coord/size/answer rules)
        if self.phase in ("decide", "y"):
            return IN_COORD, 0, (0.0, 0.0), True  # x (from the deciding hidden state) or y
        return IN_SIZE, 0, (0.0, 0.0), True

    def row_spec(self, pending: int) -> RowSpec:
        """Sampling settings and flags for the next output (a multi-step launch numbers its
        later samples step + 1, step + 2, ... on the device)."""
        tk = self.cfg.tokenizer
        seed, step = self.settings.seed or 0, self.samples + int(pending)
        if self.skill in ("detect", "point"):
            return RowSpec(seed=seed, step=step, region=True)
        s = self.settings
        eos = (tk.eos_id,) if s.ignore_eos else ()
        if self._forced_answer(pending):  # the next output is the answer's first
            return RowSpec(s.temperature, s.top_p, s.top_k, seed, step, eos)
        first = self.first_of_phase and not pending
        if self.phase == "segment":
            return RowSpec(s.temperature, s.top_p, s.top_k, seed, step, eos, segment=True)
        if self.phase == "reasoning":
            return RowSpec(s.temperature, s.top_p, s.top_k, seed, step, () if first else (tk.eos_id, tk.size_id),
                           reasoning=True)
        return RowSpec(s.temperature, s.top_p, s.top_k, seed, step, eos if first else (tk.answer_id, *eos))

    @property
    def wants_region(self) -> bool:
        return self.phase in ("decide", "x", "y", "size")

    # ----------------------------------------------------------------------------- transitions
    def advance(self, out: StepOut) -> bool:
        """Consume one step's outputs; set the next input. Returns True when the job is done."""
        self.samples += 1
        if self.phase == "text":
            return self._text(out)
        if self.phase == "reasoning":
            return self._reasoning(out)
        if self.phase == "segment":
            return self._segment(out)
        return self._region(out)

    def _finish(self, reason: str) -> bool:
        self.finish_reason = reason
        return True

    def _feed_token(self, tok: int) -> None:
        self.next_kind, self.next_token = IN_TOKEN, tok

    def _text(self, out: StepOut) -> bool:
        tk = self.cfg.tokenizer
        self.first_of_phase = False
        if out.token == tk.eos_id and not self.settings.ignore_eos:
            return self._finish("stop")
        self.tokens.append(out.token)
        if self.on_text is not None:
            self.on_text([out.token])
        if len(self.tokens) >= self.settings.max_tokens:
            return self._finish("length")
        self._feed_token(out.token)
        return False

    def _reasoning(self, out: StepOut) -> bool:
        tk = self.cfg.tokenizer
        self.first_of_phase = False
        if out.token == tk.answer_id or len(self.reasoning_tokens) >= self.settings.max_tokens:
            self.phase, self.first_of_phase = "text", True
            self._feed_token(tk.answer_id)
            return False
        self.reasoning_tokens.append(out.token)
        if out.token == tk.coord_id:
            self.grounding.append({"index": len(self.reasoning_tokens) - 1, "value": out.coord})
            self.next_kind, self.next_value = IN_COORD, (out.coord, 0.0)
        else:
            self._feed_token(out.token)
        return False

    def _segment(self, out: StepOut) -> bool:
        tk = self.cfg.tokenizer
        self.first_of_phase = False
        if out.token == tk.eos_id and not self.settings.ignore_eos:
            return self._finish("stop")
        if out.token == tk.coord_id:
            self.coords.append(out.coord)
            self.next_kind, self.next_value = IN_COORD, (out.coord, 0.0)
        elif out.token == tk.size_id:
            self.sizes.append(out.size)
            self.next_kind, self.next_value = IN_SIZE, out.size
        else:
            self.tokens.append(out.token)
            self._feed_token(out.token)
        if self.samples >= self.settings.max_tokens:
            return self._finish("length")
        return False

    def _region(self, out: StepOut) -> bool:
        tk = self.cfg.tokenizer
        if self.phase == "decide":
            decision = out.token if self.first_of_phase else out.region_next
            self.first_of_phase = False
            if decision == tk.eos_id:
                return self._finish("stop")
            if len(self.objects) >= self.max_objects:
                return self._finish("length")
            self.pending_xy = [out.coord]
            self.next_kind, self.next_value, self.phase = IN_COORD, (out.coord, 0.0), "y"
            return False
        if self.phase == "y":
            x, y = self.pending_xy[0], out.coord
            self.pending_xy = [x, y]
            self.next_kind, self.next_value = IN_COORD, (y, 0.0)
            if self.skill == "point":
                self.objects.append({"x": x, "y": y})
                self.phase = "decide"
            else:
                self.phase = "size"
            return False
        # size
        x, y = self.pending_xy
        w, h = out.size
        self.objects.append(box_from_center(x, y, w, h))
        self.next_kind, self.next_value, self.phase = IN_SIZE, (w, h), "decide"
        return False

    # ----------------------------------------------------------------------------- results
    def output(self, decode: Callable[[list[int]], str]) -> dict[str, Any]:
        if self.skill == "caption":
            return {"caption": decode(self.tokens)}
        if self.skill == "query":
            out: dict[str, Any] = {"answer": decode(self.tokens)}
            if self.reasoning:
                out["reasoning"] = {"text": decode(self.reasoning_tokens), "grounding": list(self.grounding)}
            return out
        if self.skill == "detect":
            return {"objects": list(self.objects)}
        if self.skill == "segment":
            return segment_output(self.subject, self.tokens, self.coords, self.sizes, decode)
        return {"points": list(self.objects)}

    @property
    def output_tokens(self) -> int:
        return len(self.tokens) + len(self.reasoning_tokens) if self.skill in ("caption", "query") else self.samples
