"""Single-request reference generation: the oracle the paged engine is tested against.

One sequence at a time, straightforward loops on the host: encode image -> prefill the 730-token
prefix -> prefill the skill prompt -> decode (greedy or temperature + top-p), with the reasoning
phase for `query` and the point/detect loops feeding coordinate/size embeddings back
(MOONDREAM.md §4, §6, §7.4, §9). It runs the same model code and paged-attention interface as the
engine, with a contiguous page table.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kestrel_jax.models.config import MoondreamConfig
from kestrel_jax.models.moondream import MoondreamModel
from kestrel_jax.models.region import coord_bin_to_value, size_bin_to_value
from kestrel_jax.models.text import AttentionBatch, KVCache
from kestrel_jax.pallas.paged_attention import init_kv_pool
from kestrel_jax.pallas.sampling import SamplingParams, sample_reference
from kestrel_jax.prompts import box_from_center


class GenerationError(ValueError):
    """Invalid generation settings or input (too long, bad values)."""


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 768
    seed: int = 0

    def validate(self) -> SamplingSettings:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise GenerationError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise GenerationError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise GenerationError(f"max_tokens must be >= 1, got {self.max_tokens}")
        return self


class Sampler:
    """Draws tokens exactly as the engine's in-step sampler does (`pallas.sampling`, reference
    implementation): same settings, same seed, same per-request step counter, so the reference
    path and the engine agree token for token on identical logits, sampled or greedy."""

    def __init__(self, s: SamplingSettings):
        self.s = s
        self.step = 0

    def __call__(self, logits: np.ndarray, suppressed: Sequence[int] = ()) -> int:
        sup = np.full((1, max(1, len(suppressed))), -1, np.int32)
        sup[0, : len(suppressed)] = suppressed
        params = SamplingParams(
            temperature=np.asarray([self.s.temperature], np.float32), top_k=np.zeros(1, np.int32),
            top_p=np.asarray([self.s.top_p], np.float32), seed=np.asarray([self.s.seed], np.uint32),
            step=np.asarray([self.step], np.int32), suppressed_ids=sup)
        self.step += 1
        return int(sample_reference(jnp.asarray(logits, jnp.float32)[None], params).tokens[0])


@dataclass
class Sequence_:
    cache: KVCache
    page_table: jax.Array  # [1, max_pages] int32
    length: int = 0
    prefix_len: int = 0


@dataclass
class StepOut:
    hidden: np.ndarray  # [D] pre-post_ln hidden of the last fed position
    logits: np.ndarray  # [V] float32
    captures: list[dict[str, Any]] = field(default_factory=list)
    hidden_all: np.ndarray | None = None  # [T, D] every fed position (when asked for)


def _forward(graphdef: Any, state: Any, x: jax.Array, batch: AttentionBatch, cache: KVCache,
             capture: bool) -> tuple[jax.Array, jax.Array, KVCache, list[dict[str, jax.Array]]]:
    model = nnx.merge(graphdef, state)
    hidden, cache, cap = model.text(x, batch, cache, capture=capture)
    logits = model.text.logits(hidden[-1:])[0]
    return hidden, logits, cache, cap


class ReferenceGenerator:
    """Drives one sequence through the model. Not thread-safe; one request at a time."""

    def __init__(self, model: MoondreamModel, *, page_size: int = 64, kv_dtype: jnp.dtype | None = None,
                 max_len: int | None = None, page_permutation_seed: int | None = None):
        self.model = model
        self.cfg: MoondreamConfig = model.cfg
        self.dtype = model.dtype
        self.kv_dtype = kv_dtype if kv_dtype is not None else model.dtype
        self.page_size = page_size
        self.max_len = max_len or self.cfg.text.max_context
        self.page_permutation_seed = page_permutation_seed
        self.graphdef, self.state = nnx.split(model)
        self._fwd = jax.jit(_forward, static_argnums=(0, 5), donate_argnums=(4,))

    # ---------------------------------------------------------------- sequence / KV management
    def new_sequence(self) -> Sequence_:
        t = self.cfg.text
        n_pages = -(-self.max_len // self.page_size)
        pool = init_kv_pool(t.n_layers, n_pages, self.page_size, t.n_kv_heads, t.head_dim, self.kv_dtype)
        k = tuple(kp for kp, _ in pool)
        v = tuple(vp for _, vp in pool)
        scales = self.model.text.kv_scales[...]
        table = np.arange(n_pages, dtype=np.int32)
        if self.page_permutation_seed is not None:  # any page order must give the same result
            table = np.random.default_rng(self.page_permutation_seed).permutation(table).astype(np.int32)
        cache = KVCache(k, v, scales[:, 0], scales[:, 1])
        return Sequence_(cache, jnp.asarray(table[None, :]))

    def _slots(self, seq: Sequence_, positions: np.ndarray) -> np.ndarray:
        table = np.asarray(seq.page_table[0])
        return (table[positions // self.page_size] * self.page_size + positions % self.page_size).astype(np.int32)

    def feed(self, seq: Sequence_, x: jax.Array, *, prefix_len: int = 0, capture: bool = False,
             decode: bool = False, all_hidden: bool = False) -> StepOut:
        """Append embeddings x [T, D] at the next positions; prefill (or decode when T == 1 and
        `decode`). `prefix_len` > 0 marks positions < prefix_len as bidirectional."""
        t = x.shape[0]
        if seq.length + t > self.max_len:
            raise GenerationError(
                f"sequence of {seq.length + t} tokens exceeds the context of {self.max_len}")
        pos = np.arange(seq.length, seq.length + t, dtype=np.int32)
        slots = self._slots(seq, pos)
        kv_lens = jnp.asarray([seq.length + t], jnp.int32)
        if decode:
            assert t == 1
            batch = AttentionBatch(jnp.asarray(pos), jnp.asarray(slots), kv_lens, seq.page_table)
        else:
            seq.prefix_len = max(seq.prefix_len, prefix_len)
            batch = AttentionBatch(jnp.asarray(pos), jnp.asarray(slots), kv_lens, seq.page_table,
                                   jnp.asarray([0, t], jnp.int32), jnp.asarray([seq.prefix_len], jnp.int32))
        hidden, logits, seq.cache, cap = self._fwd(self.graphdef, self.state, x.astype(self.dtype), batch,
                                                   seq.cache, capture)
        seq.length += t
        return StepOut(np.asarray(hidden[-1], np.float32), np.asarray(logits), cap,
                       np.asarray(hidden, np.float32) if all_hidden else None)

    # ---------------------------------------------------------------- embeddings
    def embed_ids(self, ids: Sequence[int]) -> jax.Array:
        ids_arr = np.asarray(ids, np.int32)
        if ids_arr.size and (ids_arr.min() < 0 or ids_arr.max() >= self.cfg.text.vocab_size):
            raise GenerationError(f"token id outside the vocabulary of {self.cfg.text.vocab_size}")
        return self.model.text.embed(jnp.asarray(ids_arr), self.dtype)

    def coord_embedding(self, value: float) -> jax.Array:  # -> [1, D]
        return self.model.region.encode_coordinate(jnp.asarray([[value]], jnp.float32), self.dtype)

    def size_embedding(self, w: float, h: float) -> jax.Array:  # -> [1, D]
        return self.model.region.encode_size(jnp.asarray([[w, h]], jnp.float32), self.dtype)

    def prompt_embeddings(self, ids: Sequence[int], coord_slots: Sequence[tuple[int, float]] = (),
                          size_slots: Sequence[tuple[int, tuple[float, float]]] = ()) -> jax.Array:
        x = self.embed_ids(ids)
        for i, val in coord_slots:
            x = x.at[i].set(self.coord_embedding(val)[0])
        for i, (w, h) in size_slots:
            x = x.at[i].set(self.size_embedding(w, h)[0])
        return x

    # ---------------------------------------------------------------- region heads (greedy bins)
    def decode_coord(self, h: np.ndarray) -> tuple[float, np.ndarray]:
        """(coordinate, its logits [1024]) decoded from one hidden state [D]."""
        logits = np.asarray(self.model.region.decode_coordinate(jnp.asarray(h[None], self.dtype))[0])
        return float(coord_bin_to_value(jnp.argmax(logits))), logits

    def decode_size(self, h: np.ndarray) -> tuple[tuple[float, float], np.ndarray]:
        """((width, height), their logits [2, 1024]) decoded from one hidden state [D]."""
        logits = np.asarray(self.model.region.decode_size(jnp.asarray(h[None], self.dtype))[0])
        w, hh = (float(size_bin_to_value(jnp.argmax(row))) for row in logits)
        return (w, hh), logits

    # ---------------------------------------------------------------- image
    def encode_image_crops(self, crops_u8: np.ndarray, tiling: tuple[int, int]) -> jax.Array:
        return _encode_image(self.graphdef, self.state, jnp.asarray(crops_u8), tuple(tiling), self.dtype)

    def prefill_image(self, seq: Sequence_, image_tokens: jax.Array, capture: bool = False) -> StepOut:
        """BOS + image tokens at positions 0..729, bidirectional."""
        x = jnp.concatenate([self.embed_ids([self.cfg.tokenizer.bos_id]), image_tokens.astype(self.dtype)])
        return self.feed(seq, x, prefix_len=x.shape[0], capture=capture)

    # ---------------------------------------------------------------- decode loops
    def decode_text(self, seq: Sequence_, first: StepOut, s: SamplingSettings, *,
                    stop_ids: Sequence[int], suppress: Sequence[int] = (),
                    sampler: Sampler | None = None,
                    on_token: Callable[[int], None] | None = None) -> tuple[list[int], str, list[np.ndarray]]:
        """Sample from `first`, feed, repeat. Returns (tokens, finish reason, per-step logits fed).

        `suppress` ids are excluded on decode steps only (not on `first`, which came from a prefill).
        """
        sampler = sampler if sampler is not None else Sampler(s)
        out: list[int] = []
        logits_seen: list[np.ndarray] = []
        logits = first.logits
        banned: Sequence[int] = ()
        while True:
            tok = sampler(logits, banned)
            if tok in stop_ids:
                return out, "stop", logits_seen
            out.append(tok)
            if on_token is not None:
                on_token(tok)
            if len(out) >= s.max_tokens:
                return out, "length", logits_seen
            if seq.length >= self.max_len:
                return out, "context", logits_seen
            step = self.feed(seq, self.embed_ids([tok]), decode=True)
            logits = step.logits
            logits_seen.append(step.logits)
            banned = suppress

    def region_loop(self, seq: Sequence_, first: StepOut, *, boxes: bool, max_objects: int,
                    clamp_boxes: bool = False) -> tuple[list[dict[str, float]], dict[str, list[Any]]]:
        """Point/detect loop (MOONDREAM.md §7.4). Returns objects and a trace of the logits. Boxes
        are the reference implementation's (unclamped) unless `clamp_boxes` (the engine's output:
        `prompts.box_from_center`)."""
        tk = self.cfg.tokenizer
        trace: dict[str, list[Any]] = {"hidden": [], "x": [], "y": [], "size": [], "next": [], "next_tok": []}
        objects: list[dict[str, float]] = []
        h, logits = first.hidden, first.logits
        tok = int(np.argmax(logits))
        while tok != tk.eos_id and len(objects) < max_objects:
            if seq.length + (3 if boxes else 2) > self.max_len:
                break
            trace["hidden"].append(h)
            x, xl = self.decode_coord(h)
            trace["x"].append(xl)
            st = self.feed(seq, self.coord_embedding(x), decode=True)
            trace["hidden"].append(st.hidden)
            y, yl = self.decode_coord(st.hidden)
            trace["y"].append(yl)
            st = self.feed(seq, self.coord_embedding(y), decode=True)
            if boxes:
                trace["hidden"].append(st.hidden)
                (w, hh), sl = self.decode_size(st.hidden)
                trace["size"].append(sl)
                st = self.feed(seq, self.size_embedding(w, hh), decode=True)
                objects.append(box_from_center(x, y, w, hh, clamp=clamp_boxes))
            else:
                objects.append({"x": x, "y": y})
            h, logits = st.hidden, st.logits
            if self.cfg.is_md3:  # binary choice between coord and eos, coord wins ties
                pair = np.asarray([logits[tk.coord_id], logits[tk.eos_id]])
                trace["next"].append(pair)
                tok = tk.coord_id if pair[0] >= pair[1] else tk.eos_id
            else:
                trace["next"].append(logits)
                tok = int(np.argmax(logits))
            trace["next_tok"].append(tok)
        return objects, trace

    def reasoning_loop(self, seq: Sequence_, first: StepOut, s: SamplingSettings,
                       sampler: Sampler) -> tuple[list[int], list[dict[str, Any]], list[np.ndarray]]:
        """Reasoning phase: sample until the answer token or max_tokens; coordinate tokens feed
        E_coord(decoded value). Returns (reasoning ids, grounding points, logits of decode steps)."""
        tk = self.cfg.tokenizer
        ids: list[int] = []
        points: list[dict[str, Any]] = []
        logits_seen: list[np.ndarray] = []
        h, logits = first.hidden, first.logits
        banned: tuple[int, ...] = ()
        while True:
            tok = sampler(logits, banned)
            if tok == tk.answer_id or len(ids) >= s.max_tokens or seq.length + 2 > self.max_len:
                break
            ids.append(tok)
            if tok == tk.coord_id:
                v, _ = self.decode_coord(h)
                points.append({"index": len(ids) - 1, "value": v})
                x = self.coord_embedding(v)
            else:
                x = self.embed_ids([tok])
            st = self.feed(seq, x, decode=True)
            logits_seen.append(st.logits)
            h = st.hidden
            logits = st.logits
            banned = (tk.eos_id, tk.size_id)
        return ids, points, logits_seen

    def segment_loop(self, seq: Sequence_, first: StepOut, s: SamplingSettings, sampler: Sampler,
                     ) -> tuple[list[int], list[float], list[tuple[float, float]], str]:
        """Segment (MOONDREAM.md §7.6): sample until EOS or max_tokens samples; a coordinate token
        feeds E_coord and a size token E_size of the value decoded (greedy bins) from the hidden
        state that sampled it, any other token itself. Returns (text ids, coordinates, sizes,
        finish reason)."""
        tk = self.cfg.tokenizer
        ids: list[int] = []
        coords: list[float] = []
        sizes: list[tuple[float, float]] = []
        h, logits = first.hidden, first.logits
        n = 0
        while True:
            tok = sampler(logits)
            if tok == tk.eos_id:
                return ids, coords, sizes, "stop"
            n += 1
            if tok == tk.coord_id:
                coords.append(self.decode_coord(h)[0])
                x = self.coord_embedding(coords[-1])
            elif tok == tk.size_id:
                sizes.append(self.decode_size(h)[0])
                x = self.size_embedding(*sizes[-1])
            else:
                ids.append(tok)
                x = self.embed_ids([tok])
            if n >= s.max_tokens:
                return ids, coords, sizes, "length"
            if seq.length >= self.max_len:
                return ids, coords, sizes, "context"
            st = self.feed(seq, x, decode=True)
            h, logits = st.hidden, st.logits


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _encode_image(graphdef: Any, state: Any, crops: jax.Array, tiling: tuple[int, int],
                  dtype: jnp.dtype) -> jax.Array:
    model = nnx.merge(graphdef, state)
    return model.vision(crops, tiling, dtype)


def replace(s: SamplingSettings, **kw: Any) -> SamplingSettings:
    return dataclasses.replace(s, **kw)
