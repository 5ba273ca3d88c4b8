"""Overlap crops made on the device from the uploaded image, byte for byte PIL's (MOONDREAM.md §5.1).

`image_crops.overlap_crops` resizes on the host with PIL LANCZOS; on the GPU machines that is tens
of milliseconds of a slow core per multi-crop image, most of such an image's time to first token.
This module reproduces PIL's resampling arithmetic exactly and runs it on the device:

* PIL (Resample.c, 8-bit images) resizes in two separable passes through an 8-bit
  intermediate. Per output pixel a pass sums `in[xmin + x] * k[x]` in 32-bit integers, starting
  from 2^21, and stores clamp(sum >> 22, 0, 255). The coefficients `k` are the Lanczos-3 weights
  computed in double precision, normalised to sum 1, then rounded to 22 fractional bits.
* `lanczos_coeffs` computes those integer coefficients on the host with PIL's exact sequence of
  double operations (numpy's float64 `sin` is checked against the C library's once, else the C
  library's is used), and `plan_crops` turns them into per-crop tables: for each of the 378
  output rows and columns of a crop, the source rows / columns it reads and their weights.
* `make_crops` (jnp, jitted by the runner per crop-count bucket) gathers and sums with int32
  arithmetic: the same integers PIL computes, so the same bytes. The vertical-first order of newer
  PIL (`image_crops.pass_order_rule`) runs as the horizontal-first code on the transposed canvas.

The image is uploaded once as a fixed `CANVAS` x `CANVAS` array (zeros past its edges, which no
table reads). Images larger than the canvas, or whose pass order PIL does not match a known rule,
return no plan: the caller uses the host path.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kestrel_jax.models.config import VisionConfig
from kestrel_jax.models.image_crops import (
    crop_window,
    image_tiling,
    pass_order_rule,
    resized_size,
    vertical_pass_first,
)

CANVAS = 1024  # images with both sides at most this are cropped on the device
MAX_TAPS = 20  # taps a table holds; PIL's Lanczos-3 uses 2 * ceil(3 * shrink) + 1 (19 for 1024 -> 378)
PRECISION_BITS = 22  # PIL's fixed point for 8-bit images: 32 - 8 - 2


class CropPlan(NamedTuple):
    """Everything the device needs to make one image's crops (host arrays)."""

    canvas: np.ndarray  # [C, C, 3] uint8: the image top-left, zeros elsewhere
    flip: np.ndarray  # [n] int32: 1 = this crop's resize runs the vertical pass first
    idx1: np.ndarray  # [n, S, K] int32: first pass, source column (row if flipped) of each tap
    w1: np.ndarray  # [n, S, K] int32: first pass weights (0 past a pixel's taps)
    idx2: np.ndarray  # [n, S, K] int32: second pass, source row (column if flipped) of each tap
    w2: np.ndarray  # [n, S, K] int32

    @property
    def num_crops(self) -> int:
        return int(self.flip.shape[0])

    def take(self, n: int) -> CropPlan:
        """The plan of its first `n` crops."""
        if not 1 <= n <= self.num_crops:
            raise ValueError(f"cannot take {n} of {self.num_crops} crops")
        return CropPlan(self.canvas, self.flip[:n], self.idx1[:n], self.w1[:n], self.idx2[:n], self.w2[:n])

    def padded(self, n: int) -> CropPlan:
        """The same plan with crops appended up to `n` (all-zero weights: all-zero crops)."""
        extra = n - self.num_crops
        if extra < 0:
            raise ValueError(f"cannot pad {self.num_crops} crops to {n}")
        if extra == 0:
            return self

        def pad(a: np.ndarray) -> np.ndarray:
            return np.concatenate([a, np.zeros((extra, *a.shape[1:]), a.dtype)])

        return CropPlan(self.canvas, pad(self.flip), pad(self.idx1), pad(self.w1), pad(self.idx2), pad(self.w2))


@functools.cache
def _numpy_sin_is_libm() -> bool:
    """numpy's float64 sin may use its own vector code; PIL calls the C library's. Compare once on
    the arguments the Lanczos filter sees."""
    x = np.random.default_rng(0).uniform(-3.0, 3.0, 20000) * math.pi
    return bool(np.array_equal(np.sin(x), np.array([math.sin(v) for v in x.tolist()])))


def _sin(x: np.ndarray) -> np.ndarray:
    if _numpy_sin_is_libm():
        return np.sin(x)
    return np.array([math.sin(v) for v in x.ravel().tolist()], np.float64).reshape(x.shape)


def _sinc(x: np.ndarray) -> np.ndarray:
    xp = x * math.pi
    with np.errstate(invalid="ignore", divide="ignore"):
        s = _sin(xp) / xp
    return np.where(x == 0.0, 1.0, s)


@functools.lru_cache(maxsize=512)
def lanczos_coeffs(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """PIL's LANCZOS coefficients for resampling `in_size` pixels to `out_size` along one axis:
    (xmin [out] int32, k [out, ksize] int32), pixel i reading in[xmin[i] + x] * k[i, x]. The float
    work follows Resample.c's precompute_coeffs and normalize_coeffs_8bpc operation by operation."""
    if in_size <= 0 or out_size <= 0:
        raise ValueError(f"sizes must be positive, got {in_size} -> {out_size}")
    scale = float(in_size) / out_size
    filterscale = max(scale, 1.0)
    support = 3.0 * filterscale
    ksize = int(math.ceil(support)) * 2 + 1
    inv = 1.0 / filterscale
    center = (np.arange(out_size, dtype=np.float64) + 0.5) * scale
    xmin = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)
    xmax = np.minimum(np.trunc(center + support + 0.5), in_size).astype(np.int64) - xmin
    taps = np.arange(ksize, dtype=np.int64)[None, :]
    t = (((taps + xmin[:, None]).astype(np.float64) - center[:, None]) + 0.5) * inv  # PIL's operation order
    inside = (t >= -3.0) & (t < 3.0) & (taps < xmax[:, None])  # Lanczos-3 support, the pixel's taps
    w = np.where(inside, _sinc(t) * _sinc(t / 3), 0.0)  # [out, ksize], 0 past each pixel's taps
    ww = np.zeros(out_size, np.float64)
    for x in range(ksize):  # PIL sums left to right (adding the zeros past xmax changes nothing)
        ww = ww + w[:, x]
    w = np.where((ww != 0.0)[:, None], w / np.where(ww != 0.0, ww, 1.0)[:, None], w)
    fixed = np.where(w < 0, -0.5 + w * (1 << PRECISION_BITS), 0.5 + w * (1 << PRECISION_BITS))
    return xmin.astype(np.int32), np.trunc(fixed).astype(np.int32)  # 0.5 + 0 truncates to 0


def _axis_table(in_size: int, out_size: int, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Taps of output pixels [first, first + count) of an `in_size` -> `out_size` pass, as absolute
    source indices and weights [count, MAX_TAPS]; an unchanged axis is the identity (PIL skips it)."""
    if in_size == out_size:
        idx = np.zeros((count, MAX_TAPS), np.int32)
        idx[:, 0] = np.arange(first, first + count)
        w = np.zeros((count, MAX_TAPS), np.int32)
        w[:, 0] = 1 << PRECISION_BITS
        return idx, w
    xmin, k = lanczos_coeffs(in_size, out_size)
    if k.shape[1] > MAX_TAPS:
        raise ValueError(f"{in_size} -> {out_size} needs {k.shape[1]} taps, more than {MAX_TAPS}")
    xmin, k = xmin[first:first + count], k[first:first + count]
    idx = np.minimum(xmin[:, None] + np.arange(MAX_TAPS, dtype=np.int32)[None, :], in_size - 1)
    w = np.zeros((count, MAX_TAPS), np.int32)
    w[:, :k.shape[1]] = k
    return idx.astype(np.int32), w


def plan_crops(image_u8: np.ndarray, vision: VisionConfig, *, canvas: int = CANVAS) -> CropPlan | None:
    """The device plan for `overlap_crops(image_u8, vision)`, or None where the device path does
    not apply (image larger than the canvas, too many taps, a PIL of unknown pass order)."""
    h, w = image_u8.shape[:2]
    if image_u8.dtype != np.uint8 or image_u8.ndim != 3 or image_u8.shape[2] != 3 or h == 0 or w == 0:
        return None
    rule = pass_order_rule()
    if rule is None or max(h, w) > canvas:
        return None
    s = vision.crop_size
    rows, cols = image_tiling(h, w, vision)
    th, tw = resized_size((rows, cols), vision)
    window = crop_window(vision)

    # (output height, output width, first output row, first output column) of each crop's resize
    crops = [(s, s, 0, 0)] + [(th, tw, i * window, j * window) for i in range(rows) for j in range(cols)]
    n = len(crops)
    flip = np.zeros((n,), np.int32)
    idx1, w1, idx2, w2 = (np.zeros((n, s, MAX_TAPS), np.int32) for _ in range(4))
    for c, (oh, ow, r0, c0) in enumerate(crops):
        try:
            ri, rw = _axis_table(h, oh, r0, s)  # output rows of the crop: source rows
            ci, cw = _axis_table(w, ow, c0, s)  # output columns: source columns
        except ValueError:  # a shrink needing more taps than a table holds
            return None
        if vertical_pass_first(rule, h, w, oh, ow):
            flip[c] = 1
            idx1[c], w1[c], idx2[c], w2[c] = ri, rw, ci, cw
        else:
            idx1[c], w1[c], idx2[c], w2[c] = ci, cw, ri, rw
    board = np.zeros((canvas, canvas, 3), np.uint8)
    board[:h, :w] = image_u8
    return CropPlan(board, flip, idx1, w1, idx2, w2)


def empty_plan(num_crops: int, crop_size: int, *, canvas: int = CANVAS) -> CropPlan:
    """A plan of the right shapes whose crops are all zeros (compiling the crop step at warm-up)."""
    t = np.zeros((num_crops, crop_size, MAX_TAPS), np.int32)
    return CropPlan(np.zeros((canvas, canvas, 3), np.uint8), np.zeros((num_crops,), np.int32), t, t, t, t)


def _clip8(acc: jax.Array) -> jax.Array:
    return jnp.clip((acc + (1 << (PRECISION_BITS - 1))) >> PRECISION_BITS, 0, 255)


def make_crops(canvas: jax.Array, flip: jax.Array, idx1: jax.Array, w1: jax.Array, idx2: jax.Array,
               w2: jax.Array) -> jax.Array:  # [n, S, S, 3] uint8
    """The crops of a `CropPlan` (arrays on the device): per crop, pass 1 over every canvas row
    (column if flipped) for the crop's S output columns (rows), then pass 2 for its S output rows
    (columns); int32 sums, PIL's rounding and clamping after each pass."""
    src = jnp.stack([canvas, jnp.swapaxes(canvas, 0, 1)]).astype(jnp.int32)  # [2, C, C, 3]
    taps = idx1.shape[-1]

    def one(f: jax.Array, i1: jax.Array, k1: jax.Array, i2: jax.Array, k2: jax.Array) -> jax.Array:
        x = src[f]  # [C, C, 3]: rows are what pass 2 reads
        acc = jnp.zeros((x.shape[0], i1.shape[0], 3), jnp.int32)
        for t in range(taps):  # pass 1 along axis 1
            acc = acc + x[:, i1[:, t], :] * k1[None, :, t, None]
        mid = _clip8(acc)  # [C, S, 3]
        acc = jnp.zeros((i2.shape[0], mid.shape[1], 3), jnp.int32)
        for t in range(taps):  # pass 2 along axis 0
            acc = acc + mid[i2[:, t], :, :] * k2[:, t, None, None]
        out = _clip8(acc)  # [S, S, 3]
        return jnp.where(f == 1, jnp.swapaxes(out, 0, 1), out)

    return jax.vmap(one)(flip, idx1, w1, idx2, w2).astype(jnp.uint8)
