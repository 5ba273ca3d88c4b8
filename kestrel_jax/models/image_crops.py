"""Image input and overlap crops (MOONDREAM.md §5.1).

`load_image` turns whatever a caller hands us (encoded bytes, a path, a file object, a PIL image,
a numpy array) into the reference's input: uint8 RGB `[H, W, 3]`, EXIF orientation applied, alpha
dropped (not composited), palettes expanded — i.e. what `PIL.Image.convert("RGB")` gives, except
for deep images (16-bit, 32-bit int and float modes), which PIL's converter clips at 255 and we
scale to 8 bits instead (round to nearest). 48-bit RGB PNGs arrive from PIL's decoder already as
8-bit RGB holding the high byte of each sample, exactly what the reference sees.

`overlap_crops` reproduces the reference tiling byte for byte: crop 0 is the whole image resized
to the crop size (aspect ratio not kept), crops 1.. are row-major windows of the image resized to
`tiles * window + 2 * margin`, all resizes with PIL LANCZOS (the reference's path when pyvips is
absent, which is what the golden crops were made with).

`resize_lanczos` is that PIL resize split across threads, with the same bytes out. PIL resamples
in two separable passes through an 8-bit intermediate (horizontal first, except that newer PIL
runs the vertical pass first when the height shrinks much more than the width), and each pass's
coefficients depend only on the sizes along its own axis. So the horizontal pass runs as
horizontal-only resizes of row strips and the vertical pass as vertical-only resizes of column
strips, in parallel (PIL releases the GIL while it resamples). One PIL call spends ~25 ms of a
core on a 756 px image's crops: most of that image's time to first token before this.
"""

from __future__ import annotations

import functools
import hashlib
import io
import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

import numpy as np
from PIL import Image, ImageOps

from kestrel_jax.models.config import VisionConfig

# The bundled demo picture (tools/make_demo_image.py draws it).
DEMO_IMAGE_PATH = Path(__file__).resolve().parents[1] / "assets" / "demo.png"

# Decoding untrusted data: refuse anything larger than this many pixels before decoding it.
DEFAULT_MAX_PIXELS = 100_000_000

ImageInput = bytes | bytearray | memoryview | str | os.PathLike[str] | IO[bytes] | Image.Image | np.ndarray

# Modes whose samples are wider than 8 bits; PIL's convert("RGB") clips them, we rescale.
_DEEP_MODES = frozenset({"I", "F", "I;16", "I;16B", "I;16L", "I;16N", "I;16S", "I;16BS", "I;16LS"})


class ImageError(ValueError):
    """The input cannot be turned into an RGB image (not an image, damaged, empty, too large)."""


# --------------------------------------------------------------------------------------------
# Loading


def load_image(x: ImageInput, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:  # [H, W, 3] u8
    """Decode / convert `x` to a fresh uint8 RGB array `[H, W, 3]`.

    Accepted: encoded image bytes (PNG, JPEG, WebP, ...), a file path, a binary file object, a
    PIL image, or a numpy array `[H, W]`, `[H, W, 1|2|3|4]` of dtype uint8, uint16 (scaled by
    255/65535), bool, another integer type with values in 0..255, or float with values in [0, 1].
    A second/fourth channel is alpha and is dropped, as `convert("RGB")` does.
    """
    if max_pixels <= 0:
        raise ImageError(f"max_pixels must be positive, got {max_pixels}")
    if isinstance(x, np.ndarray):
        return _from_array(x, max_pixels)
    if isinstance(x, Image.Image):
        return _from_pil(x, max_pixels)
    if isinstance(x, bytes | bytearray | memoryview):
        data = bytes(x)
        if not data:
            raise ImageError("empty image data (0 bytes)")
        return _decode(io.BytesIO(data), "image bytes", max_pixels)
    if isinstance(x, str | os.PathLike):
        path = os.fspath(x)
        if not os.path.isfile(path):
            raise ImageError(f"image file not found: {path!r}")
        if os.path.getsize(path) == 0:
            raise ImageError(f"image file is empty: {path!r}")
        with open(path, "rb") as f:
            return _decode(f, f"image file {path!r}", max_pixels)
    if hasattr(x, "read"):
        return _decode(x, "image stream", max_pixels)
    raise ImageError(
        f"unsupported image input of type {type(x).__name__}; pass bytes, a path, a file object, "
        "a PIL image or a numpy array"
    )


def _check_size(width: int, height: int, max_pixels: int, what: str) -> None:
    if width <= 0 or height <= 0:
        raise ImageError(f"{what} has zero size ({width}x{height})")
    if width * height > max_pixels:
        raise ImageError(
            f"{what} is {width}x{height} = {width * height} pixels, above the limit of {max_pixels}; "
            "downscale it first or raise max_pixels"
        )


def _decode(stream: IO[bytes], what: str, max_pixels: int) -> np.ndarray:
    try:
        # PIL checks its own global bomb limit here (a warning above ~89 MP, an error above
        # ~179 MP); `max_pixels` is enforced from the header right after, before any decoding.
        # The warning is left alone: silencing it would mutate process-wide warning state.
        image = Image.open(stream)
    except Image.DecompressionBombError as e:
        raise ImageError(f"{what}: {e}") from e
    except Exception as e:  # any decoder failure means "not an image we can read"
        raise ImageError(f"{what} is not a recognised image format ({type(e).__name__}: {e})") from e
    with image:
        return _from_pil(image, max_pixels, what)


def _from_pil(image: Image.Image, max_pixels: int, what: str = "PIL image") -> np.ndarray:
    _check_size(image.width, image.height, max_pixels, what)
    try:
        image.load()  # opening is lazy: damaged pixel data only shows up here
    except Exception as e:
        raise ImageError(f"{what} is truncated or damaged ({type(e).__name__}: {e})") from e
    try:
        oriented = ImageOps.exif_transpose(image)
    except Exception as e:
        raise ImageError(f"{what}: cannot apply its EXIF orientation ({type(e).__name__}: {e})") from e
    if oriented is None:  # only returned for in_place=True; keeps the type checker honest
        oriented = image
    mode = oriented.mode
    if mode in _DEEP_MODES:
        return _gray_to_rgb(_deep_to_u8(np.asarray(oriented), mode, what))
    try:
        if mode == "La":  # premultiplied LA has no direct path to RGB in PIL
            oriented = oriented.convert("LA")
        rgb = oriented.convert("RGB")
    except Exception as e:
        raise ImageError(f"{what}: cannot convert mode {mode!r} to RGB ({e})") from e
    out = np.array(rgb, dtype=np.uint8)
    assert out.ndim == 3 and out.shape[2] == 3, out.shape
    return out


def _u16_to_u8(a: np.ndarray) -> np.ndarray:
    # Exact round-to-nearest of v * 255 / 65535 in integer arithmetic (65535 -> 255, 257k -> k).
    return ((a.astype(np.uint32) * 255 + 32767) // 65535).astype(np.uint8)


def _unit_float_to_u8(a: np.ndarray, what: str) -> np.ndarray:
    a = a.astype(np.float64)
    if not np.all(np.isfinite(a)):
        raise ImageError(f"{what} contains NaN or infinite values")
    # Values within half an 8-bit step of the range round to 0 / 255 anyway: clip those.
    lo, hi = float(a.min()), float(a.max())
    half_step = 0.5 / 255
    if lo < -half_step or hi > 1 + half_step:
        raise ImageError(
            f"{what}: float pixels must lie in [0, 1], got range [{lo:g}, {hi:g}]; "
            "divide 0..255 data by 255 or pass uint8"
        )
    return np.floor(np.clip(a, 0.0, 1.0) * 255 + 0.5).astype(np.uint8)


def _deep_to_u8(a: np.ndarray, mode: str, what: str) -> np.ndarray:  # [H, W] -> [H, W] u8
    """PIL's wide single-channel modes. `I;16*` is 16-bit by definition; for `I` (int32) and `F`
    (float32) the bit depth is not recorded, so it is inferred from the value range."""
    if mode.startswith("I;16"):
        return _u16_to_u8(np.clip(a.astype(np.int64), 0, 65535))
    if mode == "F":
        if not np.all(np.isfinite(a)):
            raise ImageError(f"{what} (mode F) contains NaN or infinite values")
        if a.size and float(a.min()) >= 0.0 and float(a.max()) <= 1.0:
            return _unit_float_to_u8(a, what)
        a = np.floor(a.astype(np.float64) + 0.5)
    lo, hi = (float(a.min()), float(a.max())) if a.size else (0.0, 0.0)
    if lo >= 0 and hi <= 255:
        return a.astype(np.uint8)
    if lo >= 0 and hi <= 65535:
        return _u16_to_u8(a.astype(np.int64))
    raise ImageError(
        f"{what}: mode {mode!r} values span [{lo:g}, {hi:g}], outside both the 8-bit and the 16-bit "
        "range; rescale the image to 0..255 before passing it"
    )


def _gray_to_rgb(g: np.ndarray) -> np.ndarray:  # [H, W] -> [H, W, 3]
    return np.ascontiguousarray(np.repeat(g[:, :, None], 3, axis=2))


def _from_array(a: np.ndarray, max_pixels: int) -> np.ndarray:
    what = f"array of shape {a.shape} and dtype {a.dtype}"
    if a.ndim == 3 and a.shape[2] in (1, 2, 3, 4):
        channels = a.shape[2]
    elif a.ndim == 2:
        channels = 0
    else:
        raise ImageError(f"{what}: expected [H, W] or [H, W, C] with C in 1..4")
    _check_size(a.shape[1], a.shape[0], max_pixels, what)
    if a.dtype == np.uint8:
        u8 = a
    elif a.dtype == np.uint16:
        u8 = _u16_to_u8(a)
    elif a.dtype == np.bool_:
        u8 = a.astype(np.uint8) * 255
    elif np.issubdtype(a.dtype, np.floating):
        u8 = _unit_float_to_u8(a, what)
    elif np.issubdtype(a.dtype, np.integer):
        lo, hi = int(a.min()), int(a.max())
        if lo < 0 or hi > 255:
            raise ImageError(f"{what}: integer pixels must lie in 0..255 (got {lo}..{hi}); use uint16 "
                             "for 16-bit data")
        u8 = a.astype(np.uint8)
    else:
        raise ImageError(f"{what}: unsupported dtype; use uint8, uint16, bool or float in [0, 1]")
    if channels == 0:
        return _gray_to_rgb(u8)
    if channels <= 2:  # gray (+ alpha)
        return _gray_to_rgb(u8[:, :, 0])
    return np.array(u8[:, :, :3], dtype=np.uint8, order="C", copy=True)


# --------------------------------------------------------------------------------------------
# Parallel resize and digest

# Worker threads for resizing and hashing (shared by all callers); KESTREL_JAX_IMAGE_THREADS
# overrides the default of min(8, CPUs). 1 runs everything in the calling thread.
IMAGE_THREADS = max(1, int(os.environ.get("KESTREL_JAX_IMAGE_THREADS", 0)) or min(8, os.cpu_count() or 1))
# Below this many output pixels per pass a single PIL call is cheaper than fanning out.
_MIN_PARALLEL_PIXELS = 128 * 1024
_MIN_STRIP = 32  # rows (horizontal pass) or columns (vertical pass) per task

_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=IMAGE_THREADS, thread_name_prefix="kestrel-jax-image")
        return _pool


def _on_pool_thread() -> bool:
    return threading.current_thread().name.startswith("kestrel-jax-image")


def _parallel[T](fns: list[Callable[[], T]]) -> list[T]:
    # A task running on the pool never waits on the pool (a full pool would deadlock).
    if len(fns) == 1 or IMAGE_THREADS == 1 or _on_pool_thread():
        return [f() for f in fns]
    return [f.result() for f in [_executor().submit(f) for f in fns]]


def _pil_resize(a: np.ndarray, width: int, height: int) -> np.ndarray:
    image = Image.fromarray(np.ascontiguousarray(a))
    return np.asarray(image.resize((width, height), resample=Image.Resampling.LANCZOS))


def _bounds(n: int, parts: int) -> list[tuple[int, int]]:
    edges = [n * i // parts for i in range(parts + 1)]
    return [(lo, hi) for lo, hi in zip(edges[:-1], edges[1:], strict=True) if hi > lo]


def resize_lanczos(image: np.ndarray, width: int, height: int, *, threads: int | None = None) -> np.ndarray:
    """`PIL.Image.resize((width, height), LANCZOS)` of a uint8 [H, W, 3] array, byte for byte,
    with each pass split into strips across `threads` (default IMAGE_THREADS) workers."""
    return resize_many(image, [(width, height)], threads=threads)[0]


def resize_many(image: np.ndarray, sizes: list[tuple[int, int]], *, threads: int | None = None) -> list[np.ndarray]:
    """`resize_lanczos` of one image to several (width, height) sizes, the first passes of all of
    them in one parallel phase and the second passes in another (fewer waits than one by one).
    Each strip task writes its rows or columns straight into the pass's output array."""
    n = IMAGE_THREADS if threads is None else max(1, threads)
    rule = None if n == 1 else pass_order_rule()
    h0, w0 = image.shape[:2]
    plans: list[tuple[str, int, str, int] | None] = []
    for width, height in sizes:
        if (w0, h0) == (width, height) or rule is None:
            plans.append(None)  # a copy, or one plain PIL call (one thread, or a PIL of unknown order)
        elif vertical_pass_first(rule, h0, w0, height, width):
            plans.append(("cols", height, "rows", width))
        else:
            plans.append(("rows", width, "cols", height))
    first = [_pass(image, p[0], p[1], n) if p else (image, []) for p in plans]
    _parallel([t for _, ts in first for t in ts])
    second = [_pass(mid, p[2], p[3], n) if p else (mid, []) for p, (mid, _) in zip(plans, first, strict=True)]
    _parallel([t for _, ts in second for t in ts])
    out = []
    for (width, height), p, (res, _) in zip(sizes, plans, second, strict=True):
        if p is not None:
            out.append(res)
        elif (w0, h0) == (width, height):
            out.append(np.array(image, copy=True))
        else:
            out.append(_pil_resize(image, width, height))
    return out


@functools.cache
def pass_order_rule() -> str | None:
    """Which pass the installed PIL runs first: "horizontal" (always; older PIL) or "shrink"
    (vertical first when the height shrinks by more than twice as many pixels as the width; newer
    PIL, e.g. 13.0), found by resizing a probe image; None if neither reproduces it."""
    probe = np.random.default_rng(0).integers(0, 256, (64, 16, 3), dtype=np.uint8)
    want = _pil_resize(probe, 24, 8)  # height -56 > 2 * (width -8): the two rules differ here
    if np.array_equal(want, _pil_resize(_pil_resize(probe, 16, 8), 24, 8)):
        return "shrink"
    if np.array_equal(want, _pil_resize(_pil_resize(probe, 24, 64), 24, 8)):
        return "horizontal"
    return None


def vertical_pass_first(rule: str, height: int, width: int, out_height: int, out_width: int) -> bool:
    """Whether PIL (of pass order `rule`, see `pass_order_rule`) resizes height x width to
    out_height x out_width vertical pass first."""
    return rule == "shrink" and height - out_height > 0 and height - out_height > (width - out_width) * 2


def _pass(a: np.ndarray, axis: str, size: int, n: int) -> tuple[np.ndarray, list[Callable[[], None]]]:
    """One pass as (its output array, strip tasks that fill it): "rows" resizes row strips to
    `size` columns (horizontal only), "cols" resizes column strips to `size` rows (vertical only).
    `a` itself and no tasks if that side already has the size."""
    h, w = a.shape[:2]
    if axis == "rows":
        if size == w:
            return a, []
        out = np.empty((h, size, *a.shape[2:]), np.uint8)
        parts = min(n, -(-h // _MIN_STRIP)) if h * size >= _MIN_PARALLEL_PIXELS else 1
        return out, [functools.partial(_resize_into, a[lo:hi], out[lo:hi]) for lo, hi in _bounds(h, parts)]
    if size == h:
        return a, []
    out = np.empty((size, w, *a.shape[2:]), np.uint8)
    parts = min(n, -(-w // _MIN_STRIP)) if size * w >= _MIN_PARALLEL_PIXELS else 1
    return out, [functools.partial(_resize_into, a[:, lo:hi], out[:, lo:hi]) for lo, hi in _bounds(w, parts)]


def _resize_into(src: np.ndarray, dst: np.ndarray) -> None:
    dst[...] = _pil_resize(src, dst.shape[1], dst.shape[0])


_DIGEST_CHUNK = 1 << 20  # bytes per hashing task


def pixels_digest(pixels: np.ndarray) -> bytes:
    """Content key of an image's pixels or crops (the prefix cache's image key): SHA-256 over the
    shape and the SHA-256 of each 1 MiB chunk of the bytes, the chunks hashed in parallel."""
    data = memoryview(np.ascontiguousarray(pixels)).cast("B")
    head = repr((pixels.shape, str(pixels.dtype))).encode()
    chunks = [data[i:i + _DIGEST_CHUNK] for i in range(0, len(data), _DIGEST_CHUNK)] or [data]
    parts = _parallel([functools.partial(_sha256, c) for c in chunks])
    return hashlib.sha256(head + b"".join(p.tobytes() for p in parts)).digest()


def _sha256(data: memoryview) -> np.ndarray:
    return np.frombuffer(hashlib.sha256(data).digest(), np.uint8)


# --------------------------------------------------------------------------------------------
# Tiling and crops


def crop_window(vision: VisionConfig) -> int:
    """Pixels each local crop contributes beyond the overlap: (grid - 2 margin) * patch (266)."""
    grid = vision.crop_size // vision.enc_patch_size
    window = (grid - 2 * vision.overlap_margin) * vision.enc_patch_size
    if window <= 0:
        raise ImageError(f"overlap_margin {vision.overlap_margin} leaves no window in a {grid}-patch crop")
    return window


def margin_pixels(vision: VisionConfig) -> int:
    """Overlap per side in pixels (4 patches = 56 px)."""
    return vision.overlap_margin * vision.enc_patch_size


def select_tiling(h: int, w: int, crop_window: int, max_crops: int) -> tuple[int, int]:
    """(rows, cols) of local crops for an image whose size *minus both margins* is h x w.

    The reference rule: one tile if either side fits a window; else the minimal cover when it
    exceeds `max_crops` is shrunk by a common factor; otherwise the grid closest to the aspect
    ratio with about `max_crops` tiles, at least the minimal cover, trimmed back to the budget.
    Quirk kept for parity: when the shrunk cover rounds a side to 0 it is clamped to 1, so very
    thin images get up to floor(sqrt(max_crops * min_long / min_short)) tiles, above `max_crops`
    (34 x 1 for a 400 x 53000 image); callers must not assume at most max_crops + 1 crops.
    """
    if crop_window <= 0 or max_crops <= 0:
        raise ValueError(f"crop_window ({crop_window}) and max_crops ({max_crops}) must be positive")
    if h <= crop_window or w <= crop_window:
        return (1, 1)
    min_h = math.ceil(h / crop_window)
    min_w = math.ceil(w / crop_window)
    if min_h * min_w > max_crops:
        ratio = math.sqrt(max_crops / (min_h * min_w))
        return (max(1, math.floor(min_h * ratio)), max(1, math.floor(min_w * ratio)))
    rows = max(math.floor(math.sqrt(max_crops * h / w)), min_h)
    cols = max(math.floor(math.sqrt(max_crops * w / h)), min_w)
    if rows * cols > max_crops:
        if cols > rows:
            cols = math.floor(max_crops / rows)
        else:
            rows = math.floor(max_crops / cols)
    return (max(1, rows), max(1, cols))


def image_tiling(height: int, width: int, vision: VisionConfig) -> tuple[int, int]:
    """Tiling of a `height x width` image under `vision` (margins subtracted first)."""
    m2 = 2 * margin_pixels(vision)
    return select_tiling(height - m2, width - m2, crop_window(vision), vision.max_crops)


def resized_size(tiling: tuple[int, int], vision: VisionConfig) -> tuple[int, int]:
    """(height, width) the whole image is resized to before tiles are cut: tiles * 266 + 112."""
    window, m2 = crop_window(vision), 2 * margin_pixels(vision)
    return (tiling[0] * window + m2, tiling[1] * window + m2)


def stitched_grid_size(tiling: tuple[int, int], vision: VisionConfig) -> tuple[int, int]:
    """Patch grid of the stitched local features (§5.5): (19 rows + 8, 19 cols + 8) for 27/4."""
    grid = vision.crop_size // vision.enc_patch_size
    step, m2 = grid - 2 * vision.overlap_margin, 2 * vision.overlap_margin
    return (tiling[0] * step + m2, tiling[1] * step + m2)


def overlap_crops(
    image_u8: np.ndarray,  # [H, W, 3] uint8
    vision: VisionConfig,
) -> tuple[np.ndarray, tuple[int, int]]:  # crops [1 + rows*cols, S, S, 3] uint8, (rows, cols)
    """Global crop then row-major local crops, exactly as the reference cuts them."""
    if not isinstance(image_u8, np.ndarray):
        raise ImageError(f"overlap_crops needs a uint8 [H, W, 3] array, got {type(image_u8).__name__}")
    if image_u8.dtype != np.uint8 or image_u8.ndim != 3 or image_u8.shape[2] != 3:
        desc = f"shape {image_u8.shape} dtype {image_u8.dtype}"
        raise ImageError(f"overlap_crops needs a uint8 [H, W, 3] array (use load_image), got {desc}")
    height, width = image_u8.shape[:2]
    if height == 0 or width == 0:
        raise ImageError(f"image has zero size ({width}x{height})")
    size = vision.crop_size
    window = crop_window(vision)
    tiling = image_tiling(height, width, vision)
    rows, cols = tiling
    target_h, target_w = resized_size(tiling, vision)

    crops = np.zeros((1 + rows * cols, size, size, 3), dtype=np.uint8)
    crops[0], resized = resize_many(image_u8, [(size, size), (target_w, target_h)])
    # PIL resizes to the exact size, so every window fits; the reference's zero padding for a
    # short resize (top-left aligned copy) is kept only as the slice semantics below.
    for i in range(rows):
        for j in range(cols):
            tile = resized[i * window: i * window + size, j * window: j * window + size]
            crops[1 + i * cols + j, : tile.shape[0], : tile.shape[1]] = tile
    return crops, tiling
