"""Per-layer K/V scales for an FP8 KV cache: the file format, its checks, and calibration.

An FP8 (e4m3) KV cache stores K / k_scale and V / v_scale for each layer, clamped to +-448, and
multiplies the scale back when attention reads it. Moondream 3 checkpoints carry the scales
(`text.blocks.i.attn.{k,v}_scale`); Moondream 2 checkpoints carry none, and with a scale of 1.0
the cache keeps e4m3's fixed range whatever a layer's values are. `calibrate` measures each
layer's largest |K| and |V| on sample requests (the reference path with a cache in the model's
dtype, so nothing is clipped while measuring) and sets scale = amax * headroom / 448. `save`
writes them as JSON; `RunnerConfig.kv_scales` (`kestrel-jax serve --kv-scales FILE`) reads the
file in place of the checkpoint's scales, and with `kv_dtype` "auto" that turns the FP8 cache on
on a GPU. `compare` runs the samples greedily with the model-dtype cache and with the FP8 cache
(calibrated scales, and 1.0) and reports how many answers stay identical.

e4m3 keeps its relative precision (3 mantissa bits) over [2^-6, 448], so headroom costs little:
with the default of 2, values down to ~1e-4 of the calibrated maximum keep full precision and
values up to twice it are not clipped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kestrel_jax.checkpoint.spec import CheckpointError
from kestrel_jax.generate import ReferenceGenerator, SamplingSettings, Sequence_
from kestrel_jax.models.image_crops import ImageInput
from kestrel_jax.models.moondream import MoondreamModel
from kestrel_jax.pallas.paged_attention import FP8_MAX
from kestrel_jax.reference import ReferenceMoondream
from kestrel_jax.tokenizer import Tokenizer

FORMAT = "kestrel_jax.kv_scales"
VERSION = 1
DEFAULT_HEADROOM = 2.0
DEFAULT_QUESTIONS = ("What is in this image?", "Describe the colors and shapes you see.",
                     "How many objects are there?")


@dataclass(frozen=True)
class Sample:
    """One calibration request: `question` None is a normal-length caption."""
    image: ImageInput | None
    question: str | None = None


@dataclass
class Calibration:
    scales: np.ndarray  # [L, 2] float32: (k_scale, v_scale) per layer
    amax: np.ndarray  # [L, 2] float32: the largest |K|, |V| seen per layer
    headroom: float
    samples: int
    positions: int  # KV positions written over all samples


# ------------------------------------------------------------------------------------- files
def scales_from_amax(amax: np.ndarray, headroom: float = DEFAULT_HEADROOM) -> np.ndarray:
    """scale = amax * headroom / 448; a layer that saw no non-zero value keeps 1.0."""
    if not (math.isfinite(headroom) and headroom >= 1.0):
        raise ValueError(f"headroom must be a finite number >= 1, got {headroom}")
    a = np.asarray(amax, np.float64)
    if a.ndim != 2 or a.shape[1] != 2 or not np.all(np.isfinite(a)) or np.any(a < 0):
        raise ValueError(f"amax must be [layers, 2] finite values >= 0, got shape {a.shape}")
    return np.where(a > 0, a * headroom / FP8_MAX, 1.0).astype(np.float32)


def save(path: str | Path, calib: Calibration, *, model_name: str = "") -> Path:
    path = Path(path)
    doc = {"format": FORMAT, "version": VERSION, "model": model_name, "n_layers": int(calib.scales.shape[0]),
           "k_scale": [float(x) for x in calib.scales[:, 0]], "v_scale": [float(x) for x in calib.scales[:, 1]],
           "k_amax": [float(x) for x in calib.amax[:, 0]], "v_amax": [float(x) for x in calib.amax[:, 1]],
           "headroom": calib.headroom, "samples": calib.samples, "positions": calib.positions}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    return path


def load(path: str | Path, n_layers: int) -> np.ndarray:
    """[n_layers, 2] float32 scales from a file `save` wrote; CheckpointError when it is missing,
    not such a file, for another layer count, or holds a scale that is not a finite number > 0."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such KV scales file")
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a KV scales file (not JSON: {e})") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a KV scales file (no \"format\": \"{FORMAT}\")")
    if doc.get("version") != VERSION:
        raise CheckpointError(f"{path}: KV scales file version {doc.get('version')!r}; this build reads {VERSION}")
    cols = []
    for key in ("k_scale", "v_scale"):
        vals = doc.get(key)
        if not isinstance(vals, list) or len(vals) != n_layers:
            got = len(vals) if isinstance(vals, list) else type(vals).__name__
            raise CheckpointError(f"{path}: {key} has {got} entries; the model has {n_layers} layers")
        for i, v in enumerate(vals):  # JSON numbers only (not strings, booleans or lists)
            if isinstance(v, bool) or not isinstance(v, int | float) or not (math.isfinite(v) and v > 0):
                raise CheckpointError(f"{path}: {key}[{i}] = {v!r}; scales must be finite numbers > 0")
        cols.append(np.asarray(vals, np.float64))
    return np.stack(cols, axis=1).astype(np.float32)


def apply(model: MoondreamModel, scales: np.ndarray) -> None:
    """Put [L, 2] scales in the model in place of the checkpoint's."""
    cur = model.text.kv_scales[...]
    if tuple(scales.shape) != tuple(cur.shape):
        raise CheckpointError(f"KV scales of shape {tuple(scales.shape)} for a model with {tuple(cur.shape)}")
    model.text.kv_scales[...] = jnp.asarray(scales, jnp.float32)


# ------------------------------------------------------------------------------- calibration
class _Recording(ReferenceGenerator):
    """A reference generator that keeps the last sequence it made, to read its cache afterwards."""

    last: Sequence_ | None = None

    def new_sequence(self) -> Sequence_:
        self.last = super().new_sequence()
        return self.last


def _run(ref: ReferenceMoondream, sample: Sample, max_tokens: int) -> list[int]:
    s = SamplingSettings(temperature=0.0, top_p=1.0, max_tokens=max_tokens)
    if sample.question is None:
        if sample.image is None:
            raise ValueError("a caption sample needs an image")
        return ref.caption(sample.image, settings=s).tokens
    return ref.query(sample.image, sample.question, reasoning=False, settings=s).tokens


def _layer_amax(seq: Sequence_) -> np.ndarray:
    """[L, 2] largest |K|, |V| in the sequence's pool (zero-filled where nothing was written)."""
    def amax(pages: Sequence[jax.Array]) -> np.ndarray:
        return np.asarray([float(jnp.max(jnp.abs(p.astype(jnp.float32)))) for p in pages], np.float32)

    return np.stack([amax(seq.cache.k), amax(seq.cache.v)], axis=1)


def calibrate(model: MoondreamModel, tokenizer: Tokenizer, samples: Iterable[Sample], *, max_tokens: int = 32,
              headroom: float = DEFAULT_HEADROOM) -> Calibration:
    """Run each sample greedily on the reference path (cache in the model's dtype) and take each
    layer's largest |K| and |V| over the prompt and the generated positions."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    ref = ReferenceMoondream(model, tokenizer)
    gen = _Recording(model, max_len=ref.gen.max_len)
    ref.gen = gen
    amax = np.zeros((model.cfg.text.n_layers, 2), np.float32)
    n = positions = 0
    for sample in samples:
        gen.last = None
        _run(ref, sample, max_tokens)
        assert gen.last is not None
        amax = np.maximum(amax, _layer_amax(gen.last))
        positions += gen.last.length
        n += 1
    if n == 0:
        raise ValueError("no calibration samples")
    return Calibration(scales_from_amax(amax, headroom), amax, float(headroom), n, positions)


def _answers(model: MoondreamModel, tokenizer: Tokenizer, samples: Sequence[Sample], max_tokens: int,
             kv_dtype: Any) -> list[list[int]]:
    ref = ReferenceMoondream(model, tokenizer)
    ref.gen = ReferenceGenerator(model, kv_dtype=kv_dtype, max_len=ref.gen.max_len)
    return [_run(ref, s, max_tokens) for s in samples]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def compare(model: MoondreamModel, tokenizer: Tokenizer, samples: Sequence[Sample], scales: np.ndarray, *,
            max_tokens: int = 32, unit: bool = True) -> dict[str, Any]:
    """Greedy answers with the model-dtype cache against the FP8 cache with `scales` (and, with
    `unit`, with 1.0): per setting, how many answers are identical and the mean share of each
    answer's tokens before the first difference. The model's own scales are restored afterwards."""
    base = _answers(model, tokenizer, samples, max_tokens, model.dtype)
    saved = np.asarray(model.text.kv_scales[...])
    out: dict[str, Any] = {"samples": len(samples), "max_tokens": max_tokens}
    settings = [("calibrated", scales)] + ([("unit", np.ones_like(saved))] if unit else [])
    try:
        for name, sc in settings:
            apply(model, np.asarray(sc, np.float32))
            got = _answers(model, tokenizer, samples, max_tokens, jnp.float8_e4m3fn)
            same = [a == b for a, b in zip(base, got, strict=True)]
            agree = [_common_prefix(a, b) / max(1, len(a)) for a, b in zip(base, got, strict=True)]
            out[name] = {"identical": int(sum(same)), "mean_agreeing_share": round(float(np.mean(agree)), 4)}
    finally:
        apply(model, saved)
    return out
