"""Device-made overlap crops: byte for byte the host's PIL crops (and the golden crops)."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import numpy as np
import pytest
from PIL import Image

from kestrel_jax.models import device_crops as dc
from kestrel_jax.models.config import md2_config, md3_config
from kestrel_jax.models.image_crops import load_image, overlap_crops

VISION = md2_config().vision
S = VISION.crop_size
_REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(os.environ.get("KESTREL_GOLDEN_DIR", _REPO / ".." / "shared" / "golden"))
N = 13  # every plan padded to one crop count: one compile for the module

_make = jax.jit(dc.make_crops)


def _rng() -> np.random.Generator:
    return np.random.default_rng(int.from_bytes(os.urandom(4), "little"))


def _device(image: np.ndarray, canvas: int = dc.CANVAS) -> np.ndarray:
    plan = dc.plan_crops(image, VISION, canvas=canvas)
    assert plan is not None, image.shape
    out = np.asarray(_make(*plan.padded(N)))
    assert not out[plan.num_crops:].any()  # padding crops (zero weights) are zeros
    return out[:plan.num_crops]


@pytest.mark.parametrize("hw", [(300, 300), (379, 378), (500, 700), (756, 756), (1024, 768), (768, 1024),
                                (1000, 90), (90, 1000), (640, 480), (700, 380), (1, 1), (2, 900), (1024, 1024)])
def test_device_crops_equal_pil_crops(hw):
    # Shapes cover upscales, shrinks up to 1024 -> 378 (19 taps), an unchanged side, both PIL pass
    # orders (vertical first on newer PIL for tall shrinks) and one-pixel images.
    img = _rng().integers(0, 256, size=(*hw, 3), dtype=np.uint8)
    want, _ = overlap_crops(img, VISION)
    got = _device(img)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_device_crops_random_sizes():
    rng = _rng()
    for _ in range(6):
        h, w = (int(v) for v in rng.integers(1, dc.CANVAS + 1, 2))
        img = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
        np.testing.assert_array_equal(_device(img), overlap_crops(img, VISION)[0], err_msg=f"{h}x{w}")


@pytest.mark.skipif(not (GOLDEN / "crops.safetensors").is_file(), reason="golden vectors not available")
def test_golden_crops_on_the_device():
    from safetensors.numpy import load_file

    golden = load_file(str(GOLDEN / "crops.safetensors"))
    plan = dc.plan_crops(load_image(GOLDEN / "image.png"), md3_config().vision)
    assert plan is not None
    got = np.asarray(_make(*plan.padded(N)))[:plan.num_crops]
    np.testing.assert_array_equal(got, golden["crops_uint8"])


def test_no_plan_where_the_device_path_does_not_apply(monkeypatch):
    rng = _rng()
    assert dc.plan_crops(rng.integers(0, 256, (dc.CANVAS + 1, 10, 3), dtype=np.uint8), VISION) is None
    assert dc.plan_crops(rng.integers(0, 256, (600, 600, 3), dtype=np.uint8), VISION, canvas=512) is None
    assert dc.plan_crops(np.zeros((10, 10, 3), np.float32), VISION) is None
    # more taps than a table holds: a 1600 px side shrinks 4.2x onto the 378 px global crop
    assert dc.plan_crops(rng.integers(0, 256, (1600, 50, 3), dtype=np.uint8), VISION, canvas=2048) is None
    monkeypatch.setattr(dc, "pass_order_rule", lambda: None)  # a PIL whose pass order is unknown
    assert dc.plan_crops(rng.integers(0, 256, (300, 300, 3), dtype=np.uint8), VISION) is None


def test_coefficients_without_numpy_sin(monkeypatch):
    # Where numpy's sin is not the C library's, the tables come from math.sin: the same integers
    # here (where they agree), and still PIL's crops.
    want = {k: dc.lanczos_coeffs(*k) for k in [(756, 378), (756, 910), (300, 378), (1024, 378)]}
    dc.lanczos_coeffs.cache_clear()
    monkeypatch.setattr(dc, "_numpy_sin_is_libm", lambda: False)
    try:
        for key, (xmin, k) in want.items():
            got_xmin, got_k = dc.lanczos_coeffs(*key)
            np.testing.assert_array_equal(got_xmin, xmin)
            np.testing.assert_array_equal(got_k, k)
    finally:
        dc.lanczos_coeffs.cache_clear()


def test_coefficients_are_pils_one_axis_resize():
    # One pass in numpy from the tables against a one-axis PIL resize (which PIL runs as exactly
    # that pass), for shrinks and stretches.
    rng = _rng()
    for in_size, out_size in [(756, 378), (378, 910), (97, 378), (1024, 378), (5, 378), (378, 377)]:
        row = rng.integers(0, 256, size=(3, in_size, 3), dtype=np.uint8)
        xmin, k = dc.lanczos_coeffs(in_size, out_size)
        idx = np.minimum(xmin[:, None] + np.arange(k.shape[1])[None, :], in_size - 1)
        acc = (row[:, idx, :].astype(np.int64) * k[None, :, :, None]).sum(axis=2) + (1 << 21)
        got = np.clip(acc >> 22, 0, 255).astype(np.uint8)
        want = np.asarray(Image.fromarray(row).resize((out_size, 3), Image.Resampling.LANCZOS))
        np.testing.assert_array_equal(got, want, err_msg=f"{in_size} -> {out_size}")


def test_plan_padding_and_empty_plan():
    img = _rng().integers(0, 256, size=(500, 700, 3), dtype=np.uint8)
    plan = dc.plan_crops(img, VISION)
    assert plan is not None and plan.num_crops == 9 and plan.padded(9) is plan
    assert plan.padded(13).num_crops == 13
    with pytest.raises(ValueError, match="cannot pad"):
        plan.padded(5)
    empty = dc.empty_plan(2, S, canvas=64)
    assert not np.asarray(_make(*empty)).any()

