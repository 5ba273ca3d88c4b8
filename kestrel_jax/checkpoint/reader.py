"""Read a local Moondream safetensors checkpoint (HF or internal names, single or sharded).

`HFCheckpoint.open(path)` parses every header, maps stored names to canonical ones, infers the
config (config.json + tensor shapes) and validates every tensor's presence, shape and dtype
before a single byte of tensor data is read. `iter_tensors()` then streams canonical tensors
as numpy arrays one at a time. Local files only; nothing here touches the network.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from kestrel_jax.checkpoint.infer import infer_config
from kestrel_jax.checkpoint.names import (
    FOURIER_FEATURES,
    canonical_of,
    is_ignorable,
    stored_name_of,
)
from kestrel_jax.checkpoint.safetensors_io import DTYPES, FileHeader, TensorEntry, read_header, read_range
from kestrel_jax.checkpoint.spec import CheckpointError, TensorSpec, expected_tensors
from kestrel_jax.models.config import Family, MoondreamConfig

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_MAX_LISTED = 20  # problems listed in one validation error
_TAU = re.compile(r"^text\.blocks\.\d+\.attn\.tau\.")
_EXPERT_W = re.compile(r"^text\.blocks\.\d+\.mlp\.fc[12]\.(weight|scale)$")
_KV_SCALE = re.compile(r"^text\.blocks\.\d+\.attn\.[kv]_scale$")


@dataclass(frozen=True)
class _Source:
    """Where a canonical tensor's data lives and how to turn the stored bytes into it."""

    canonical: str
    header: FileHeader
    entry: TensorEntry
    rows: tuple[int, int] | None  # a row range of the stored tensor (tau_wqwv halves)
    transpose: bool  # legacy Fourier features, stored [n, 1] / [n, 2]

    @property
    def shape(self) -> tuple[int, ...]:
        s = self.entry.shape
        if self.rows is not None:
            s = (self.rows[1] - self.rows[0], *s[1:])
        return s[::-1] if self.transpose else s

    @property
    def nbytes(self) -> int:
        if self.rows is None:
            return self.entry.nbytes
        return self.entry.nbytes // self.entry.shape[0] * (self.rows[1] - self.rows[0])

    def describe(self) -> str:
        e = self.entry
        return f"tensor {self.canonical} (stored {e.name!r} {e.dtype}{list(e.shape)} in {self.header.path})"


def _resolve_files(path: Path) -> tuple[list[Path], Path | None, dict[str, str] | None]:
    """(safetensors files, index path, weight_map) for a directory or a single file."""
    if path.is_file():
        return [path], None, None
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such file or directory (only local checkpoints are supported)")
    index = path / INDEX_NAME
    if index.is_file():
        try:
            obj = json.loads(index.read_text())
            weight_map = obj["weight_map"]
            if not isinstance(weight_map, dict) or not weight_map:
                raise TypeError("weight_map is not a non-empty object")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        files: list[Path] = []
        for name, fname in weight_map.items():
            shard = path / str(fname)
            if Path(str(fname)).name != str(fname):
                raise CheckpointError(f"{index}: tensor {name!r} points outside the directory: {fname!r}")
            if not shard.is_file():
                raise CheckpointError(f"{index}: shard {fname!r} (holding tensor {name!r}) does not exist")
            if shard not in files:
                files.append(shard)
        return files, index, {str(k): str(v) for k, v in weight_map.items()}
    single = path / SINGLE_NAME
    if single.is_file():
        return [single], None, None
    present = sorted(p.name for p in path.iterdir())
    raise CheckpointError(
        f"{path}: neither {SINGLE_NAME} nor {INDEX_NAME} found (directory holds {present[:10]}); "
        "pass the .safetensors file itself if it is named differently"
    )


class HFCheckpoint:
    """A validated checkpoint: config, flags, and canonical tensors available to stream."""

    def __init__(self, path: Path, config: MoondreamConfig, raw_config: dict[str, Any],
                 sources: dict[str, _Source], specs: dict[str, TensorSpec], *, fp8_experts: bool,
                 kv_scales: bool, layout: str, ignored: tuple[str, ...], assumed: tuple[str, ...],
                 progress: bool):
        self.path = path
        self.config = config
        self.raw_config = raw_config  # config.json contents ({} if there was none)
        self.specs = specs  # canonical name -> TensorSpec, validated
        self.fp8_experts = fp8_experts
        self.kv_scales = kv_scales
        self.region_ln = config.region.has_ln
        self.layout = layout  # "hf" or "internal" (majority of stored names)
        self.ignored = ignored  # stored names skipped as non-persistent buffers
        self.assumed = assumed  # config keys neither config.json nor shapes determined
        self.progress = progress
        self._sources = sources

    # ---------------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | Path, *, config_json: str | Path | None = None,
             progress: bool = True) -> HFCheckpoint:
        """Validate the checkpoint at `path` (directory or .safetensors file). `config_json`:
        explicit config.json path; default: the one in / beside the checkpoint, if any."""
        path = Path(path)
        files, index, weight_map = _resolve_files(path)
        headers = [read_header(f) for f in files]
        if weight_map is not None:
            _check_index(index, headers, weight_map)
        sources, ignored, layout_votes = _map_names(headers)
        family: Family = "md3" if any(_TAU.match(n) for n in sources) else "md2"
        region_ln = family == "md3" and any(n.startswith("region.ln.") for n in sources)
        # FP8 experts: 3-D expert stacks stored as float8, or their scale tensors. (A float8
        # dense layer, or scales in an MD2 checkpoint, are left to the validator to report.)
        fp8 = family == "md3" and any(
            _EXPERT_W.match(n) and ((len(s.shape) == 3 and s.entry.dtype.startswith("F8"))
                                    or n.endswith(".scale"))
            for n, s in sources.items())
        kv = any(_KV_SCALE.match(n) for n in sources)

        cfg_path = Path(config_json) if config_json is not None else (
            (path if path.is_dir() else path.parent) / "config.json")
        raw: dict[str, Any] = {}
        if config_json is not None or cfg_path.is_file():
            try:
                raw = json.loads(cfg_path.read_text())
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{cfg_path}: cannot read config.json ({e})") from e
            if not isinstance(raw, dict):
                raise CheckpointError(f"{cfg_path}: config.json is not a JSON object")
        shapes = {n: s.shape for n, s in sources.items()}
        config, assumed = infer_config(raw, str(cfg_path), shapes, lambda n: sources[n].describe(),
                                       family, region_ln)
        specs = expected_tensors(config, fp8_experts=fp8, kv_scales=kv, region_ln=region_ln)
        layout = "hf" if layout_votes >= 0 else "internal"
        _validate(specs, sources, layout, index or files[0])
        return cls(path, config, raw, sources, specs, fp8_experts=fp8, kv_scales=kv, layout=layout,
                   ignored=tuple(ignored), assumed=assumed, progress=progress)

    # ---------------------------------------------------------------------------------------
    def __contains__(self, name: object) -> bool:
        return name in self.specs

    def __len__(self) -> int:
        return len(self.specs)

    @property
    def names(self) -> list[str]:
        """Canonical names in declaration order (vision, text, region)."""
        return list(self.specs)

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self._sources.values())

    def stored_dtype(self, name: str) -> np.dtype:
        return DTYPES[self._source(name).entry.dtype]

    def read(self, name: str) -> np.ndarray:
        """One canonical tensor: its stored dtype (bf16/f16/f32; fp8 experts as
        float8_e4m3fn), except FP8 and KV scales, which are always float32."""
        src = self._source(name)
        shape = src.shape[::-1] if src.transpose else src.shape
        begin = src.entry.begin + (0 if src.rows is None else src.rows[0] * (src.nbytes // shape[0]))
        raw = read_range(src.header, src.entry, begin, src.nbytes)
        arr = raw.view(DTYPES[src.entry.dtype]).reshape(shape)
        if src.transpose:
            arr = np.ascontiguousarray(arr.T)
        if self.specs[name].kind in ("fp8_scale", "kv_scale"):
            arr = arr.astype(np.float32)
        return arr

    def iter_tensors(self, progress: bool | None = None) -> Iterator[tuple[str, np.ndarray]]:
        """Yield (canonical name, array) for every tensor, in on-disk order, one at a time."""
        order = sorted(self._sources.values(), key=lambda s: (str(s.header.path), s.entry.begin,
                                                              s.rows or (0, 0)))
        show = self.progress if progress is None else progress
        with tqdm(total=self.total_bytes, unit="B", unit_scale=True, desc="checkpoint",
                  disable=not show) as bar:
            for src in order:
                arr = self.read(src.canonical)
                bar.update(src.nbytes)
                yield src.canonical, arr

    def _source(self, name: str) -> _Source:
        if name not in self._sources:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in this checkpoint")
        return self._sources[name]


# -------------------------------------------------------------------------------------------
# Validation steps


def _check_index(index: Path | None, headers: list[FileHeader], weight_map: dict[str, str]) -> None:
    for h in headers:
        for stored in h.entries:
            if weight_map.get(stored) != h.path.name:
                where = weight_map.get(stored)
                raise CheckpointError(
                    f"{index}: tensor {stored!r} is in shard {h.path.name!r} but the index "
                    + (f"maps it to {where!r}" if where else "does not list it")
                )
    by_file = {h.path.name: h for h in headers}
    for stored, fname in weight_map.items():
        if stored not in by_file[fname].entries:
            raise CheckpointError(f"{index}: tensor {stored!r} is mapped to shard {fname!r}, which lacks it")


def _map_names(headers: list[FileHeader]) -> tuple[dict[str, _Source], list[str], int]:
    """(canonical -> source, ignored stored names, layout vote: >= 0 means HF names)."""
    sources: dict[str, _Source] = {}
    ignored: list[str] = []
    votes = 0
    for h in headers:
        for stored, entry in h.entries.items():
            if is_ignorable(stored):
                ignored.append(stored)
                continue
            match = canonical_of(stored)
            votes += 1 if stored.startswith(("model.", "vision.", "text.", "region.")) else -1
            for k, canon in enumerate(match.canonical):
                rows = None
                if match.row_split:
                    if len(entry.shape) != 2 or entry.shape[0] % 2:
                        raise CheckpointError(
                            f"{h.path}: tensor {stored!r} {entry.dtype}{list(entry.shape)} should be "
                            f"[2*n_heads, qkv] (tau.wq rows then tau.wv rows)"
                        )
                    half = entry.shape[0] // 2
                    rows = (k * half, (k + 1) * half)
                src = _Source(canon, h, entry, rows, _is_transposed_fourier(canon, entry.shape))
                if canon in sources:
                    raise CheckpointError(
                        f"two stored tensors map to {canon}: {sources[canon].entry.name!r} in "
                        f"{sources[canon].header.path} and {stored!r} in {h.path}"
                    )
                sources[canon] = src
    return sources, ignored, votes


def _is_transposed_fourier(canonical: str, shape: tuple[int, ...]) -> bool:
    """Legacy layouts store the frequency matrices as [n, 1] / [n, 2]; canonical is [1, n] / [2, n]."""
    if canonical not in FOURIER_FEATURES or len(shape) != 2:
        return False
    rows = 1 if canonical == "region.coord_features" else 2
    return shape[1] == rows and shape[0] != rows


def _validate(specs: dict[str, TensorSpec], sources: dict[str, _Source], layout: str, where: Path) -> None:
    problems: list[str] = []
    for name, spec in specs.items():
        src = sources.get(name)
        if src is None:
            expert = len(spec.shape) == 3
            stored = stored_name_of(name, "hf" if layout == "hf" else "internal", expert=expert)
            problems.append(f"missing tensor {name} (expected stored as {stored!r} "
                            f"{'/'.join(sorted(spec.dtypes))}{list(spec.shape)}) in {where}")
            continue
        if src.shape != spec.shape:
            problems.append(f"{src.describe()}: shape {list(src.shape)}, expected {list(spec.shape)}")
        if src.entry.dtype not in spec.dtypes:
            problems.append(f"{src.describe()}: dtype {src.entry.dtype}, expected one of "
                            f"{sorted(spec.dtypes)}")
    for name, src in sources.items():
        if name not in specs:
            problems.append(f"unexpected {src.describe()}: not part of this model")
    if problems:
        more = f"\n... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise CheckpointError(f"checkpoint {where} failed validation ({len(problems)} problems):\n  "
                              + "\n  ".join(problems[:_MAX_LISTED]) + more)
