"""Image loading and overlap crops: the §5.1 table, the golden crops, odd inputs and bad data."""

from __future__ import annotations

import io
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from kestrel_jax.models import image_crops
from kestrel_jax.models.config import VisionConfig, md2_config, md3_config
from kestrel_jax.models.image_crops import (
    DEMO_IMAGE_PATH,
    ImageError,
    crop_window,
    image_tiling,
    load_image,
    margin_pixels,
    overlap_crops,
    resized_size,
    select_tiling,
    stitched_grid_size,
)

VISION = md2_config().vision
_REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(os.environ.get("KESTREL_GOLDEN_DIR", _REPO / ".." / "shared" / "golden"))


def _rng() -> np.random.Generator:
    return np.random.default_rng(int.from_bytes(os.urandom(4), "little"))


def _encode(image: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png(width: int, height: int, bit_depth: int, color_type: int, rows: bytes | None) -> bytes:
    """A minimal PNG written by hand (PIL cannot write 48-bit RGB or arbitrary headers)."""
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    out = b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr)
    if rows is not None:
        out += _png_chunk(b"IDAT", zlib.compress(rows))
    return out + _png_chunk(b"IEND", b"")


# --------------------------------------------------------------------------------------------
# Tiling rule and the worked examples of MOONDREAM.md §5.1

TABLE = [
    # (H, W), tiling, resized (H, W), crops, stitched grid (H, W)
    ((378, 378), (1, 1), (378, 378), 2, (27, 27)),
    ((300, 300), (1, 1), (378, 378), 2, (27, 27)),
    ((480, 640), (2, 4), (644, 1176), 9, (46, 84)),
    ((720, 1280), (2, 4), (644, 1176), 9, (46, 84)),
    ((1080, 1920), (2, 4), (644, 1176), 9, (46, 84)),
    ((3000, 4000), (2, 4), (644, 1176), 9, (46, 84)),
    ((800, 600), (4, 2), (1176, 644), 9, (84, 46)),
    ((1024, 1024), (3, 3), (910, 910), 10, (65, 65)),
    ((500, 3000), (1, 8), (378, 2240), 9, (27, 160)),
]


def test_geometry_constants():
    assert crop_window(VISION) == 266 and margin_pixels(VISION) == 56
    assert crop_window(md3_config().vision) == 266
    # Derived from the config, not fixed: a 2-patch margin widens the window.
    assert crop_window(VisionConfig(overlap_margin=2)) == (27 - 4) * 14
    with pytest.raises(ImageError, match="no window"):
        crop_window(VisionConfig(overlap_margin=14))


@pytest.mark.parametrize(("hw", "tiling", "resized", "n_crops", "grid"), TABLE)
def test_worked_examples(hw, tiling, resized, n_crops, grid):
    h, w = hw
    assert image_tiling(h, w, VISION) == tiling
    assert select_tiling(h - 112, w - 112, 266, 12) == tiling
    assert resized_size(tiling, VISION) == resized
    assert stitched_grid_size(tiling, VISION) == grid
    # Run the crops on a cheap image (a gradient) to check the count and shapes end to end.
    img = np.broadcast_to((np.arange(w) % 251).astype(np.uint8)[None, :, None], (h, w, 3)).copy()
    crops, got_tiling = overlap_crops(img, VISION)
    assert got_tiling == tiling
    assert crops.shape == (n_crops, 378, 378, 3) and crops.dtype == np.uint8


def test_tiling_budget_and_bounds():
    rng = _rng()
    sizes = list(rng.integers(1, 20000, size=(400, 2))) + [(1, 6000), (6000, 1), (379, 100000), (100000, 379)]
    for h, w in sizes:
        for max_crops in (1, 4, 12, 30):
            rows, cols = select_tiling(int(h), int(w), 266, max_crops)
            assert rows >= 1 and cols >= 1
            # The budget holds except where the over-budget branch clamps a side up to 1.
            if rows > 1 and cols > 1:
                assert rows * cols <= max_crops, (h, w, max_crops, rows, cols)
            if h <= 266 or w <= 266:
                assert (rows, cols) == (1, 1)
    with pytest.raises(ValueError):
        select_tiling(500, 500, 0, 12)


def test_thin_images_can_exceed_the_crop_budget():
    # Reference quirk kept for parity: the shrunk cover clamps the short side to 1 tile, so a
    # very tall thin image gets floor(sqrt(N * min_h / min_w)) rows, more than max_crops.
    h, w = 53000 - 112, 400 - 112  # min cover 200 x 2
    assert select_tiling(h, w, 266, 12) == (34, 1)
    assert select_tiling(w, h, 266, 12) == (1, 34)


def test_over_budget_cover_is_scaled_down():
    # 400 x 6000: the minimal cover (2 x 23) exceeds 12 crops -> shrink by sqrt(12 / 46).
    assert image_tiling(400, 6000, VISION) == (1, 11)
    # 6000 x 6000: cover 23 x 23 -> 3 x 3.
    assert image_tiling(6000, 6000, VISION) == (3, 3)


# --------------------------------------------------------------------------------------------
# Crops


@pytest.mark.skipif(not (GOLDEN / "crops.safetensors").is_file(), reason="golden vectors not available")
def test_golden_crops_byte_exact():
    from safetensors.numpy import load_file

    golden = load_file(str(GOLDEN / "crops.safetensors"))
    for source in (GOLDEN / "image.png", (GOLDEN / "image.png").read_bytes()):
        image = load_image(source)
        assert image.shape == (500, 700, 3)
        crops, tiling = overlap_crops(image, md3_config().vision)
        assert tiling == tuple(int(t) for t in golden["tiling"])
        assert crops.dtype == golden["crops_uint8"].dtype
        np.testing.assert_array_equal(crops, golden["crops_uint8"])


def test_crops_are_lanczos_windows_row_major():
    rng = _rng()
    img = rng.integers(0, 256, size=(700, 520, 3), dtype=np.uint8)
    crops, (rows, cols) = overlap_crops(img, VISION)
    # 588 x 408 after margins: cover 3 x 2, aspect grid floor(sqrt(12 * 588/408)) = 4 x 2.
    assert (rows, cols) == (4, 2)
    pil = Image.fromarray(img)
    np.testing.assert_array_equal(crops[0], np.asarray(pil.resize((378, 378), Image.Resampling.LANCZOS)))
    big = np.asarray(pil.resize((2 * 266 + 112, 4 * 266 + 112), Image.Resampling.LANCZOS))
    for i in range(rows):
        for j in range(cols):
            window = big[266 * i: 266 * i + 378, 266 * j: 266 * j + 378]
            np.testing.assert_array_equal(crops[1 + i * cols + j], window)


@pytest.mark.parametrize("hw", [(1, 1), (2, 3), (1, 6000), (6000, 1), (378, 378)])
def test_small_and_extreme_shapes_give_one_tile(hw):
    rng = _rng()
    img = rng.integers(0, 256, size=(*hw, 3), dtype=np.uint8)
    crops, tiling = overlap_crops(img, VISION)
    assert tiling == (1, 1) and crops.shape == (2, 378, 378, 3)
    # For a single tile the local crop is the whole image at 378 x 378, i.e. the global crop.
    np.testing.assert_array_equal(crops[0], crops[1])
    if hw == (1, 1):
        assert np.all(crops == img[0, 0])


def test_overlap_crops_rejects_bad_arrays():
    with pytest.raises(ImageError, match="uint8"):
        overlap_crops(np.zeros((10, 10, 3), np.float32), VISION)
    with pytest.raises(ImageError, match="uint8"):
        overlap_crops(np.zeros((10, 10, 4), np.uint8), VISION)
    with pytest.raises(ImageError, match="zero size"):
        overlap_crops(np.zeros((0, 10, 3), np.uint8), VISION)
    with pytest.raises(ImageError):
        overlap_crops([[1, 2, 3]], VISION)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# load_image: arrays


def test_array_inputs_dtypes_and_channels():
    rng = _rng()
    rgb = rng.integers(0, 256, size=(5, 7, 3), dtype=np.uint8)
    out = load_image(rgb)
    np.testing.assert_array_equal(out, rgb)
    out[0, 0] = 255 - out[0, 0]
    assert not np.array_equal(out, rgb), "load_image must not alias its input"
    np.testing.assert_array_equal(load_image(rgb[:, ::-1]), rgb[:, ::-1])

    rgba = np.concatenate([rgb, rng.integers(0, 256, size=(5, 7, 1), dtype=np.uint8)], axis=2)
    np.testing.assert_array_equal(load_image(rgba), rgb)  # alpha dropped, not composited
    gray = rgb[:, :, 0]
    for g in (gray, gray[:, :, None], np.stack([gray, gray], axis=2)):
        np.testing.assert_array_equal(load_image(g), np.repeat(gray[:, :, None], 3, axis=2))

    u16 = rng.integers(0, 65536, size=(4, 6, 3), dtype=np.uint16)
    u16[0, :3, 0] = [0, 65535, 257 * 7]
    np.testing.assert_array_equal(load_image(u16), np.round(u16 / 257.0).astype(np.uint8))

    f = rng.random((4, 6, 3))
    f[0, 0] = [0.0, 1.0, 1 + 1e-4]
    np.testing.assert_array_equal(load_image(f.astype(np.float32)),
                                  np.floor(np.clip(f.astype(np.float32), 0, 1) * 255 + 0.5).astype(np.uint8))
    np.testing.assert_array_equal(load_image(np.array([[True, False]])), [[[255] * 3, [0] * 3]])
    ints = rng.integers(0, 256, size=(3, 3, 3)).astype(np.int64)
    np.testing.assert_array_equal(load_image(ints), ints.astype(np.uint8))


@pytest.mark.parametrize(
    ("array", "match"),
    [
        (np.full((4, 4, 3), np.nan, np.float32), "NaN"),
        (np.array([[[0.1, np.inf, 0.2]]]), "NaN"),
        (np.full((4, 4, 3), 2.0), r"\[0, 1\]"),
        (np.full((4, 4, 3), -0.5), r"\[0, 1\]"),
        (np.full((4, 4, 3), 300, np.int32), "0..255"),
        (np.zeros((2, 4, 4, 3), np.uint8), r"\[H, W\]"),
        (np.zeros((4,), np.uint8), r"\[H, W\]"),
        (np.zeros((4, 4, 5), np.uint8), r"\[H, W\]"),
        (np.zeros((0, 4, 3), np.uint8), "zero size"),
        (np.zeros((4, 0), np.uint8), "zero size"),
        (np.zeros((4, 4, 3), np.complex64), "dtype"),
    ],
)
def test_bad_arrays(array, match):
    with pytest.raises(ImageError, match=match):
        load_image(array)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_pixel_limit():
    with pytest.raises(ImageError, match="above the limit"):
        load_image(np.zeros((20, 20, 3), np.uint8), max_pixels=399)
    assert load_image(np.zeros((20, 20, 3), np.uint8), max_pixels=400).shape == (20, 20, 3)
    # A header claiming 11000 x 10000 px (over the default 100 MP) is refused before decoding.
    with pytest.raises(ImageError, match="above the limit"):
        load_image(_png(11000, 10000, 8, 2, None))
    # Far beyond PIL's own bomb threshold: still an ImageError, never a decode attempt.
    with pytest.raises(ImageError):
        load_image(_png(100000, 100000, 8, 2, None))
    with pytest.raises(ImageError, match="max_pixels"):
        load_image(np.zeros((2, 2, 3), np.uint8), max_pixels=0)


# --------------------------------------------------------------------------------------------
# load_image: encoded data and PIL modes


def test_sources_bytes_path_stream_pil(tmp_path):
    rng = _rng()
    rgb = rng.integers(0, 256, size=(9, 11, 3), dtype=np.uint8)
    data = _encode(Image.fromarray(rgb))
    path = tmp_path / "x.png"
    path.write_bytes(data)
    for source in (data, bytearray(data), memoryview(data), str(path), path, io.BytesIO(data),
                   Image.open(io.BytesIO(data))):
        np.testing.assert_array_equal(load_image(source), rgb)
    with pytest.raises(ImageError, match="not found"):
        load_image(tmp_path / "missing.png")
    (tmp_path / "empty.png").write_bytes(b"")
    with pytest.raises(ImageError, match="empty"):
        load_image(tmp_path / "empty.png")
    with pytest.raises(ImageError, match="unsupported image input"):
        load_image(12345)  # type: ignore[arg-type]


def test_modes_match_convert_rgb():
    rng = _rng()
    rgb = rng.integers(0, 256, size=(8, 10, 3), dtype=np.uint8)
    base = Image.fromarray(rgb)
    rgba = Image.fromarray(np.concatenate([rgb, rng.integers(0, 256, (8, 10, 1), dtype=np.uint8)], 2))
    palette = base.quantize(colors=16)
    palette.info["transparency"] = 0
    for image in (base.convert("L"), rgba, palette, base.convert("1"), base.convert("LA"),
                  base.convert("YCbCr"), base.convert("CMYK")):
        expected = np.asarray(image.convert("RGB"))
        fmt = "TIFF" if image.mode in ("CMYK", "YCbCr") else "PNG"
        np.testing.assert_array_equal(load_image(_encode(image, fmt)), expected, err_msg=image.mode)
        np.testing.assert_array_equal(load_image(image), expected, err_msg=image.mode)
    gray = load_image(_encode(base.convert("L")))
    assert np.array_equal(gray[..., 0], gray[..., 1]) and np.array_equal(gray[..., 1], gray[..., 2])


def test_cmyk_colours():
    cmyk = Image.new("CMYK", (4, 4), (0, 255, 255, 0))  # pure red in naive CMYK
    assert load_image(_encode(cmyk, "TIFF"))[0, 0].tolist() == [255, 0, 0]
    assert load_image(_encode(Image.new("CMYK", (4, 4), (0, 0, 0, 255)), "TIFF"))[0, 0].tolist() == [0, 0, 0]


def test_16_bit_png_is_scaled_not_clipped():
    rng = _rng()
    values = rng.integers(0, 65536, size=(6, 8), dtype=np.uint16)
    values[0, :4] = [0, 255, 32768, 65535]
    data = _encode(Image.fromarray(values))
    assert Image.open(io.BytesIO(data)).mode.startswith("I;16")
    out = load_image(data)
    expected = np.round(values / 257.0).astype(np.uint8)
    np.testing.assert_array_equal(out, np.repeat(expected[:, :, None], 3, axis=2))
    assert out[0, :4, 0].tolist() == [0, 1, 128, 255]  # PIL's convert would give 0, 255, 255, 255


def test_48_bit_png():
    rng = _rng()
    values = rng.integers(0, 65536, size=(5, 6, 3), dtype=np.uint16)
    rows = b"".join(b"\x00" + values[r].astype(">u2").tobytes() for r in range(values.shape[0]))
    out = load_image(_png(6, 5, 16, 2, rows))
    assert out.shape == (5, 6, 3) and out.dtype == np.uint8
    # PIL's PNG decoder keeps the high byte of each 16-bit sample (the reference sees the same).
    np.testing.assert_array_equal(out, values >> 8)


def test_wide_pil_modes():
    rng = _rng()
    i32 = rng.integers(0, 65536, size=(4, 5)).astype(np.int32)
    np.testing.assert_array_equal(load_image(Image.fromarray(i32, mode="I"))[..., 0], np.round(i32 / 257.0))
    small = rng.integers(0, 256, size=(4, 5)).astype(np.int32)
    np.testing.assert_array_equal(load_image(Image.fromarray(small, mode="I"))[..., 0], small)
    f = rng.random((4, 5)).astype(np.float32)
    np.testing.assert_array_equal(load_image(Image.fromarray(f, mode="F"))[..., 2], np.floor(f * 255 + 0.5))
    with pytest.raises(ImageError, match="NaN"):
        load_image(Image.fromarray(np.full((2, 2), np.nan, np.float32), mode="F"))
    with pytest.raises(ImageError, match="range"):
        load_image(Image.fromarray(np.full((2, 2), -5, np.int32), mode="I"))


@pytest.mark.parametrize("orientation", [6, 8, 3])
def test_exif_orientation_is_applied(orientation):
    # Stored 60 wide x 40 tall, top half red and bottom half blue.
    stored = np.zeros((40, 60, 3), np.uint8)
    stored[:20] = (255, 0, 0)
    stored[20:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = _encode(Image.fromarray(stored), "JPEG", exif=exif.tobytes(), quality=95)
    for source in (data, Image.open(io.BytesIO(data))):
        out = load_image(source)
        red_side = {
            6: out[:, -10:],  # rotate 90 clockwise to display: the top edge goes to the right
            8: out[:, :10],  # rotate 90 counter-clockwise: top goes to the left
            3: out[-10:, :],  # rotate 180: top goes to the bottom
        }[orientation]
        assert out.shape == ((60, 40, 3) if orientation in (6, 8) else (40, 60, 3))
        assert red_side[..., 0].mean() > 200 and red_side[..., 2].mean() < 50


def test_bad_encoded_data():
    with pytest.raises(ImageError, match="empty"):
        load_image(b"")
    with pytest.raises(ImageError, match="not a recognised image"):
        load_image(_rng().bytes(4096))
    rng = _rng()
    data = _encode(Image.fromarray(rng.integers(0, 256, size=(64, 64, 3), dtype=np.uint8)))
    with pytest.raises(ImageError, match="truncated"):
        load_image(data[: len(data) // 2])
    lazy = Image.open(io.BytesIO(data[: len(data) // 2]))  # a PIL image whose pixels are missing
    with pytest.raises(ImageError, match="truncated"):
        load_image(lazy)
    with pytest.raises(ImageError, match="zero size|not a recognised"):
        load_image(_png(0, 10, 8, 2, b""))


# --------------------------------------------------------------------------------------------
# Bundled demo image


def test_demo_image_is_bundled_and_reproducible():
    import importlib.util

    asset = _REPO / "kestrel_jax" / "assets" / "demo.png"
    assert asset == DEMO_IMAGE_PATH
    assert asset.is_file() and asset.stat().st_size < 150_000
    image = load_image(asset)
    assert image.shape == (480, 640, 3)
    assert len(np.unique(image.reshape(-1, 3), axis=0)) > 50  # a picture, not a flat fill
    spec = importlib.util.spec_from_file_location("make_demo_image", _REPO / "tools" / "make_demo_image.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    np.testing.assert_array_equal(np.asarray(module.make_demo_image()), image)
    assert overlap_crops(image, VISION)[1] == (2, 4)


# --------------------------------------------------------------------------------------------
# Parallel resize and digest


def _pil_lanczos(img: np.ndarray, width: int, height: int) -> np.ndarray:
    return np.asarray(Image.fromarray(img).resize((width, height), Image.Resampling.LANCZOS))


def testpass_order_rule_is_known():
    # The strip split needs to know which pass PIL runs first; an unknown PIL falls back to one
    # plain call (still correct, not parallel). The pinned PIL must be a known one.
    assert image_crops.pass_order_rule() in ("horizontal", "shrink")


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_resize_lanczos_is_pil_byte_for_byte(threads, monkeypatch):
    # Strips even on small images, so that every case below is really split.
    monkeypatch.setattr(image_crops, "_MIN_PARALLEL_PIXELS", 0)
    monkeypatch.setattr(image_crops, "_MIN_STRIP", 4)
    rng = _rng()
    cases = [
        (756, 756, 910, 910), (756, 756, 378, 378), (500, 700, 378, 378), (1, 1, 378, 378),
        (2, 300, 378, 378), (300, 2, 64, 37), (256, 192, 294, 227), (64, 16, 24, 8),
        (120, 40, 36, 40), (120, 40, 40, 39), (50, 60, 60, 50), (33, 120, 97, 150),
    ]
    cases += [(int(a), int(b), int(c), int(d)) for a, b, c, d in rng.integers(1, 400, (12, 4))]
    for h, w, ow, oh in cases:
        img = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
        got = image_crops.resize_lanczos(img, ow, oh, threads=threads)
        np.testing.assert_array_equal(got, _pil_lanczos(img, ow, oh), err_msg=f"{(h, w)} -> {(oh, ow)}")


def test_resize_lanczos_default_split_and_same_size_copy():
    rng = _rng()
    img = rng.integers(0, 256, size=(756, 756, 3), dtype=np.uint8)
    np.testing.assert_array_equal(image_crops.resize_lanczos(img, 910, 910), _pil_lanczos(img, 910, 910))
    same = image_crops.resize_lanczos(img, 756, 756)
    np.testing.assert_array_equal(same, img)
    same[0, 0] ^= 1  # a copy, not a view of the caller's array
    assert img[0, 0, 0] != same[0, 0, 0]


def test_resize_lanczos_from_a_pool_thread_does_not_deadlock(monkeypatch):
    # A pool task that resizes runs its strips itself instead of waiting on the (full) pool.
    monkeypatch.setattr(image_crops, "_MIN_PARALLEL_PIXELS", 0)
    rng = _rng()
    img = rng.integers(0, 256, size=(300, 200, 3), dtype=np.uint8)
    pool = image_crops._executor()
    futures = [pool.submit(image_crops.resize_lanczos, img, 150, 420) for _ in range(2 * image_crops.IMAGE_THREADS)]
    want = _pil_lanczos(img, 150, 420)
    for f in futures:
        np.testing.assert_array_equal(f.result(timeout=60), want)


def test_pixels_digest_keys_content_and_shape():
    rng = _rng()
    crops = rng.integers(0, 256, size=(10, 378, 378, 3), dtype=np.uint8)  # > 1 hashing chunk
    d = image_crops.pixels_digest(crops)
    assert d == image_crops.pixels_digest(crops.copy()) and len(d) == 32
    changed = crops.copy()
    changed[9, 377, 377, 2] ^= 1  # last byte, last chunk
    assert image_crops.pixels_digest(changed) != d
    changed = crops.copy()
    changed[0, 0, 0, 0] ^= 1
    assert image_crops.pixels_digest(changed) != d
    # same bytes, another shape (another tiling): another key
    assert image_crops.pixels_digest(crops.reshape(5, 756, 378, 3)) != d


@pytest.mark.parametrize("threads", [1, 4])
def test_resize_many_is_pil_for_every_size(threads, monkeypatch):
    # Several target sizes share the two parallel phases; each result is PIL's, whatever the mix
    # of pass orders, unchanged sides and same-size copies.
    monkeypatch.setattr(image_crops, "_MIN_PARALLEL_PIXELS", 0)
    monkeypatch.setattr(image_crops, "_MIN_STRIP", 4)
    rng = _rng()
    img = rng.integers(0, 256, size=(120, 90, 3), dtype=np.uint8)
    sizes = [(90, 120), (45, 120), (90, 30), (36, 40), (200, 150), (24, 8), (378, 378)]
    got = image_crops.resize_many(img, sizes, threads=threads)
    assert len(got) == len(sizes)
    for (w, h), out in zip(sizes, got, strict=True):
        np.testing.assert_array_equal(out, _pil_lanczos(img, w, h), err_msg=f"-> {(h, w)}")
