"""Safetensors files at the byte level: strict header parsing, ranged reads, streaming writes.

Format: 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {str: str}}, then the data section; offsets are
relative to the start of the data section, tensors are C-contiguous little-endian.

Why our own code instead of the `safetensors` package: its numpy front end cannot represent
bfloat16/float8 (ml_dtypes), its loaders map or read whole files, and `save_file` needs every
tensor in memory at once (a full-size MD3 is ~18.5 GB). Here headers are validated before any
data is touched, each read is one tensor (or a row range of one), and writes stream.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from kestrel_jax.checkpoint.spec import CheckpointError

# Safetensors dtype code -> numpy dtype (little-endian; ml_dtypes for the non-IEEE types).
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("<u1"),
    "I8": np.dtype("<i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_CODE_OF = {dt: code for code, dt in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024  # the reference implementation's limit as well


def dtype_code(dtype: np.dtype | type) -> str:
    dt = np.dtype(dtype)
    if dt not in _CODE_OF:
        raise CheckpointError(f"dtype {dt} cannot be stored in safetensors")
    return _CODE_OF[dt]


@dataclass(frozen=True)
class TensorEntry:
    name: str  # stored name
    dtype: str  # safetensors dtype code
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class FileHeader:
    path: Path
    entries: dict[str, TensorEntry]  # in file order
    metadata: dict[str, str]
    header_bytes: bytes  # the raw 8 + N leading bytes, to detect later changes
    file_size: int
    mtime_ns: int


def read_header(path: Path) -> FileHeader:
    """Parse and validate a safetensors header; raise CheckpointError naming the file."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: {st.st_size} bytes, too short to be a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n == 0 or n > _MAX_HEADER:
                raise CheckpointError(
                    f"{path}: header length {n} is not plausible (corrupt or not safetensors)"
                )
            if 8 + n > st.st_size:
                raise CheckpointError(
                    f"{path}: truncated: header needs {8 + n} bytes, file has {st.st_size}"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from e
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: header is not valid JSON ({e}); corrupt or not safetensors") from e
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    data_start = 8 + n
    metadata = obj.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: __metadata__ is not an object")
    entries: dict[str, TensorEntry] = {}
    for name, info in obj.items():
        entries[name] = _parse_entry(path, name, info, data_start)
    ordered = sorted(entries.values(), key=lambda e: (e.begin, e.end))
    for prev, cur in zip(ordered, ordered[1:], strict=False):
        if cur.begin < prev.end and cur.nbytes and prev.nbytes:
            raise CheckpointError(
                f"{path}: tensors {prev.name!r} and {cur.name!r} overlap in the data section"
            )
    for ent in ordered:
        if ent.end > st.st_size:
            raise CheckpointError(
                f"{path}: truncated: tensor {ent.name!r} needs bytes {ent.begin}..{ent.end}, "
                f"file has {st.st_size}"
            )
    return FileHeader(path, {ent.name: ent for ent in ordered}, {str(k): str(v) for k, v in metadata.items()},
                      head + raw, st.st_size, st.st_mtime_ns)


def _parse_entry(path: Path, name: str, info: object, data_start: int) -> TensorEntry:
    bad = f"{path}: header entry for tensor {name!r}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{bad} is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPES:
        raise CheckpointError(f"{bad} has unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CheckpointError(f"{bad} has invalid shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets) or not 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(f"{bad} has invalid data_offsets {offsets!r}")
    expect = math.prod(shape) * DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != expect:
        raise CheckpointError(
            f"{bad}: data_offsets span {offsets[1] - offsets[0]} bytes, {dtype}{shape} needs {expect}"
        )
    return TensorEntry(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def read_range(header: FileHeader, entry: TensorEntry, begin: int, nbytes: int) -> np.ndarray:
    """Read `nbytes` at absolute offset `begin` (inside `entry`) into a fresh uint8 array,
    after checking the file is still the one that was validated."""
    path = header.path
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if (st.st_size, st.st_mtime_ns) != (header.file_size, header.mtime_ns):
                # Modified since validation: accept only if the header is byte-identical and
                # the tensor still fits (a rewrite with identical layout is indistinguishable).
                if f.read(len(header.header_bytes)) != header.header_bytes:
                    raise CheckpointError(
                        f"{path}: file changed since it was validated (header differs); "
                        f"reading tensor {entry.name!r} aborted, reopen the checkpoint"
                    )
                if st.st_size < entry.end:
                    raise CheckpointError(
                        f"{path}: truncated after validation: tensor {entry.name!r} needs bytes up to "
                        f"{entry.end}, file now has {st.st_size}"
                    )
            buf = np.empty(nbytes, dtype=np.uint8)
            f.seek(begin)
            got = f.readinto(memoryview(buf))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read tensor {entry.name!r}: {e}") from e
    if got != nbytes:
        raise CheckpointError(
            f"{path}: truncated: tensor {entry.name!r} read {got} of {nbytes} bytes at offset {begin}"
        )
    return buf


class StreamingWriter:
    """Writes one safetensors file tensor by tensor, holding at most one chunk in memory.

    The header needs every tensor's byte range, so all (name, dtype, shape) are declared up
    front; data must then be supplied in declaration order, possibly in row chunks. The file is
    written to `<path>.partial` and renamed on `close()`, so an interrupted run leaves no file
    that looks complete.
    """

    def __init__(self, path: Path, entries: Iterable[tuple[str, str, tuple[int, ...]]],
                 metadata: Mapping[str, str] | None = None):
        self.path = Path(path)
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = dict(metadata)
        self._plan: list[tuple[str, str, tuple[int, ...], int]] = []
        offset = 0
        for name, dtype, shape in entries:
            nbytes = math.prod(shape) * DTYPES[dtype].itemsize
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._plan.append((name, dtype, tuple(shape), nbytes))
            offset += nbytes
        self.data_size = offset
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # keep the data section 8-byte aligned
        self._tmp = self.path.with_name(self.path.name + ".partial")
        self._f = open(self._tmp, "wb")  # noqa: SIM115 - closed in close()/abort()
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._index = 0  # tensor being written
        self._written = 0  # bytes of it written so far

    def write(self, name: str, chunk: np.ndarray) -> None:
        """Append `chunk` (the whole tensor, or its next rows along axis 0) to tensor `name`."""
        if self._index >= len(self._plan):
            raise CheckpointError(f"{self.path}: tensor {name!r} written after all declared tensors")
        exp_name, dtype, shape, nbytes = self._plan[self._index]
        if name != exp_name:
            raise CheckpointError(f"{self.path}: expected tensor {exp_name!r} next, got {name!r}")
        if chunk.dtype != DTYPES[dtype] or (tuple(chunk.shape[1:]) != shape[1:] and chunk.shape != shape):
            raise CheckpointError(
                f"{self.path}: tensor {name!r} declared {dtype}{list(shape)}, got chunk "
                f"{chunk.dtype}{list(chunk.shape)}"
            )
        data = np.ascontiguousarray(chunk).view(np.uint8).reshape(-1)
        if self._written + data.size > nbytes:
            raise CheckpointError(f"{self.path}: tensor {name!r} given more data than {dtype}{list(shape)}")
        self._f.write(memoryview(data))
        self._written += data.size
        if self._written == nbytes:
            self._index += 1
            self._written = 0

    def close(self) -> None:
        if self._index != len(self._plan):
            missing = self._plan[self._index][0]
            self.abort()
            raise CheckpointError(f"{self.path}: closed before tensor {missing!r} was written")
        self._f.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        self._f.close()
        self._tmp.unlink(missing_ok=True)
