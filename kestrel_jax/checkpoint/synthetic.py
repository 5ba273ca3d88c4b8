"""Random Moondream checkpoints with the real names, shapes and dtypes, any size.

Values: weights N(0, std); LayerNorm weight 1, bias 0; other biases 0; lm_head bias -1e4 on ids
< suppress_ids (so a random model never emits EOS/control tokens and benchmarks run to
max_tokens); tau alpha and Fourier frequencies N(0, 1); FP8 experts are N(0, std) weights
quantised to e4m3 per output row (scale = row absmax / 448); KV scales 0.05.

Each canonical tensor draws from its own generator seeded by (seed, crc32(name)), so values do
not depend on layout, sharding or which other tensors exist, and a seed gives identical bytes.
Tensors are generated in row chunks and streamed to disk: memory stays at one chunk, which is
what lets a full-size MD3 (~18.5 GB in bf16) be written on a 24 GiB machine.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
from tqdm import tqdm

from kestrel_jax.checkpoint.names import TAU_PAIR, Layout, stored_name_of, tau_wqwv_name
from kestrel_jax.checkpoint.reader import INDEX_NAME, SINGLE_NAME
from kestrel_jax.checkpoint.safetensors_io import DTYPES, StreamingWriter
from kestrel_jax.checkpoint.spec import CheckpointError, TensorSpec, expected_tensors
from kestrel_jax.models.config import MoondreamConfig, config_to_dict

FP8_MAX = 448.0  # largest finite float8_e4m3fn
KV_SCALE = 0.05
_CHUNK_ELEMS = 1 << 23  # rows generated per step: ~8M values (32 MB of float32)
_WEIGHT_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


@dataclass(frozen=True)
class _Stored:
    """One tensor as it will sit in the file, built from one or more canonical tensors."""

    name: str
    dtype: str  # safetensors code
    shape: tuple[int, ...]
    parts: tuple[str, ...]  # canonical names, concatenated along axis 0 (tau_wqwv) or just one
    transpose: bool = False  # legacy Fourier feature layout

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


def _stored_plan(specs: dict[str, TensorSpec], layout: Layout, weight_code: str) -> list[_Stored]:
    def code(spec: TensorSpec) -> str:
        if spec.kind == "fp8_weight":
            return "F8_E4M3"
        return "F32" if spec.kind in ("fp8_scale", "kv_scale") else weight_code

    plan: list[_Stored] = []
    for name, spec in specs.items():
        if layout == "hf":
            plan.append(_Stored(f"model.{name}", code(spec), spec.shape, (name,)))
        elif name.endswith(TAU_PAIR[0]):
            # Kestrel's internal layout fuses tau.wq and tau.wv into one [2H, qkv] tensor.
            wv = name[: -len(TAU_PAIR[0])] + TAU_PAIR[1]
            layer = int(name.split(".")[2])
            shape = (spec.shape[0] + specs[wv].shape[0], *spec.shape[1:])
            plan.append(_Stored(tau_wqwv_name(layer), code(spec), shape, (name, wv)))
        elif name.endswith(TAU_PAIR[1]):
            continue
        elif name in ("region.coord_features", "region.size_features"):
            plan.append(_Stored(stored_name_of(name, "internal"), code(spec), spec.shape[::-1], (name,),
                                transpose=True))
        else:
            stored = stored_name_of(name, "internal", expert=len(spec.shape) == 3)
            plan.append(_Stored(stored, code(spec), spec.shape, (name,)))
    return plan


class _Generator:
    """Produces each canonical tensor's values in row chunks (see module docstring)."""

    def __init__(self, specs: dict[str, TensorSpec], *, seed: int, std: float, suppress_ids: int,
                 weight_dtype: np.dtype):
        self.specs, self.seed, self.std, self.suppress_ids = specs, seed, std, suppress_ids
        self.weight_dtype = weight_dtype
        self._scales: dict[str, np.ndarray] = {}  # fp8 weight name -> its [E, rows] scales

    def _rng(self, name: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(name.encode())])

    def chunks(self, name: str) -> Iterator[np.ndarray]:
        spec = self.specs[name]
        shape, kind = spec.shape, spec.kind
        wd = self.weight_dtype
        if kind in ("bias", "ln_bias"):
            yield np.zeros(shape, wd)
        elif kind == "ln_weight":
            yield np.ones(shape, wd)
        elif kind == "lm_bias":
            bias = np.zeros(shape, np.float32)
            bias[: self.suppress_ids] = -1.0e4
            yield bias.astype(wd)
        elif kind == "kv_scale":
            yield np.full(shape, KV_SCALE, np.float32)
        elif kind == "fp8_scale":
            weight = name[: -len("scale")] + "weight"
            if weight not in self._scales:  # weight not generated yet: regenerate to get scales
                for _ in self.chunks(weight):
                    pass
            yield self._scales.pop(weight)
        elif kind in ("weight", "normal", "fp8_weight"):
            std = 1.0 if kind == "normal" else self.std
            rng = self._rng(name)
            row = math.prod(shape[1:]) if shape else 1
            step = max(1, _CHUNK_ELEMS // max(row, 1))
            scales = []
            for r0 in range(0, shape[0] if shape else 1, step):
                n = min(step, shape[0] - r0) if shape else 1
                x = rng.standard_normal((n, *shape[1:]) if shape else (), dtype=np.float32)
                x *= np.float32(std)
                if kind == "fp8_weight":
                    q, s = _quantise_rows(x)
                    scales.append(s)
                    yield q
                else:
                    yield x.astype(wd)
            if kind == "fp8_weight":
                self._scales[name] = np.concatenate(scales)
        else:  # pragma: no cover - TensorSpec.kind is a closed Literal
            raise AssertionError(kind)

    def full(self, name: str) -> np.ndarray:
        shape = self.specs[name].shape
        return np.concatenate(list(self.chunks(name))).reshape(shape) if shape else next(self.chunks(name))


def _quantise_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [..., K] f32 -> (e4m3 [..., K], scale [...] f32) with w ~= q * scale[..., None]."""
    scale = np.abs(w).max(axis=-1) / np.float32(FP8_MAX)
    scale = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)
    q = (w / scale[..., None]).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def _split_shards(plan: list[_Stored], shards: int) -> list[list[_Stored]]:
    """Contiguous groups of roughly equal bytes, none empty."""
    if not 1 <= shards <= len(plan):
        raise CheckpointError(f"shards must be between 1 and {len(plan)} (tensors), got {shards}")
    total = sum(s.nbytes for s in plan)
    groups: list[list[_Stored]] = [[] for _ in range(shards)]
    done, last = 0, -1  # bytes placed so far, last non-empty group
    for k, item in enumerate(plan):
        g = min(shards - 1, done * shards // max(total, 1))
        g = min(max(g, last), last + 1)  # contiguous: never go back, never skip a shard
        g = max(g, shards - (len(plan) - k))  # leave at least one tensor for every later shard
        groups[g].append(item)
        done, last = done + item.nbytes, g
    return groups


def write_synthetic_checkpoint(
    out_dir: str | Path,
    cfg: MoondreamConfig,
    *,
    seed: int,
    layout: Layout = "hf",
    shards: int = 1,
    fp8_experts: bool = False,
    kv_scales: bool = False,
    region_ln: bool | None = None,
    std: float = 0.02,
    suppress_ids: int = 16,
    dtype: str = "bfloat16",
    tokenizer: bool = True,
    overwrite: bool = False,
    progress: bool = False,
) -> Path:
    """Write config.json, the safetensors file(s) (+ index when sharded) and tokenizer.json
    (`kestrel_jax.tokenizer.build_synthetic_tokenizer`) into `out_dir`; returns `out_dir`."""
    if layout not in ("hf", "internal"):
        raise CheckpointError(f"layout must be 'hf' or 'internal', got {layout!r}")
    if dtype not in _WEIGHT_DTYPES:
        raise CheckpointError(f"dtype must be one of {sorted(_WEIGHT_DTYPES)}, got {dtype!r}")
    if region_ln is None:
        region_ln = cfg.region.has_ln
    specs = expected_tensors(cfg, fp8_experts=fp8_experts, kv_scales=kv_scales, region_ln=region_ln)
    plan = _stored_plan(specs, layout, _WEIGHT_DTYPES[dtype])
    groups = _split_shards(plan, shards)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stale = [p for p in out.iterdir() if p.name in (SINGLE_NAME, INDEX_NAME, "config.json", "tokenizer.json")
             or (p.name.startswith("model-") and p.name.endswith(".safetensors"))]
    if stale and not overwrite:
        raise CheckpointError(f"{out}: already holds {sorted(p.name for p in stale)}; pass overwrite=True")
    for p in stale:
        p.unlink()

    gen = _Generator(specs, seed=seed, std=std, suppress_ids=suppress_ids,
                     weight_dtype=DTYPES[_WEIGHT_DTYPES[dtype]])
    names = ([SINGLE_NAME] if shards == 1
             else [f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards)])
    bar = tqdm(total=sum(s.nbytes for s in plan), unit="B", unit_scale=True, desc="synthetic",
               disable=not progress)
    with bar:
        for fname, group in zip(names, groups, strict=True):
            writer = StreamingWriter(out / fname, [(s.name, s.dtype, s.shape) for s in group],
                                     metadata={"format": "pt"})
            try:
                for item in group:
                    for chunk in _stored_chunks(gen, item):
                        writer.write(item.name, chunk)
                        bar.update(chunk.nbytes)
                writer.close()
            except BaseException:
                writer.abort()
                raise
    if shards > 1:
        index = {"metadata": {"total_size": sum(s.nbytes for s in plan)},
                 "weight_map": {s.name: fname for fname, g in zip(names, groups, strict=True) for s in g}}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    config = {
        "architectures": ["HfMoondream"],
        "model_type": "moondream1",
        "moondream_family": cfg.name,
        "torch_dtype": dtype,
        "config": config_to_dict(cfg),
        "synthetic": {"seed": seed, "layout": layout, "fp8_experts": fp8_experts, "kv_scales": kv_scales,
                      "region_ln": region_ln, "std": std, "suppress_ids": suppress_ids},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer:
        from kestrel_jax.tokenizer import build_synthetic_tokenizer

        build_synthetic_tokenizer(cfg.text.vocab_size, seed).save(str(out / "tokenizer.json"))
    return out


def _stored_chunks(gen: _Generator, item: _Stored) -> Iterator[np.ndarray]:
    if len(item.parts) > 1:  # tau_wqwv: two small canonical tensors stacked by rows
        yield np.concatenate([gen.full(p) for p in item.parts])
    elif item.transpose:
        yield np.ascontiguousarray(gen.full(item.parts[0]).T)
    else:
        yield from gen.chunks(item.parts[0])
