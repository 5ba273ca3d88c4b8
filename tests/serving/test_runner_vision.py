"""The runner's image step: an image with a 1x1 tiling (its only tile is the global crop's pixels)
is encoded from one crop in vision bucket 1, and gives what encoding both crops gives: on host
crops and on crops made on the device, against the two-crop bucket and against the model's own
(unbucketed) encoder."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kestrel_jax.models.config import tiny_config
from kestrel_jax.models.device_crops import plan_crops
from kestrel_jax.models.image_crops import overlap_crops
from kestrel_jax.models.moondream import MoondreamModel, random_model
from kestrel_jax.serving.runner import Runner, RunnerConfig


@pytest.fixture(scope="module")
def model() -> MoondreamModel:
    return random_model(tiny_config("md2", vision_layers=2), dtype=jnp.float32, seed=21)


def _runner(model: MoondreamModel, buckets: tuple[int, ...]) -> Runner:
    return Runner(model, RunnerConfig(num_pages=8, kv_dtype="f32", max_seq_len=256, page_size=64,
                                      vision_buckets=buckets, device_crops="on"), out_rows=4)


def _spy(runner: Runner) -> list[int]:
    seen: list[int] = []
    vision = runner._vision

    def spy(params: object, batch: jnp.ndarray, rows: object, cols: object) -> object:
        seen.append(int(batch.shape[0]))
        return vision(params, batch, rows, cols)

    runner._vision = spy  # type: ignore[assignment]
    return seen


@pytest.mark.parametrize("shape", [(378, 378), (300, 340), (41, 377)])
def test_one_by_one_tiling_encodes_one_crop_and_equals_two(model: MoondreamModel, shape: tuple[int, int]) -> None:
    img = np.random.default_rng(sum(shape)).integers(0, 255, (*shape, 3), dtype=np.uint8)
    crops, tiling = overlap_crops(img, model.cfg.vision)
    assert tiling == (1, 1) and crops.shape[0] == 2
    shared, both = _runner(model, (1, 5)), _runner(model, (2,))
    seen = _spy(shared)
    one = np.asarray(shared.encode_image(crops, tiling))
    two = np.asarray(both.encode_image(crops, tiling))
    plan = plan_crops(img, model.cfg.vision, canvas=shared.config.crop_canvas)
    assert plan is not None
    from_plan = np.asarray(shared.encode_image(plan, tiling))
    assert seen == [1, 1]  # host crops and the device's: one crop each
    want = np.asarray(model.vision(jnp.asarray(crops), tiling, jnp.float32))  # the unbucketed encoder
    scale = np.abs(want).max()
    for got in (one, two, from_plan):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)
    # asked not to share (the warm-up), the two crops go to the next bucket
    np.testing.assert_allclose(np.asarray(shared.encode_image(crops, tiling, share_tile=False)), want, rtol=0,
                               atol=1e-5 * scale)
    assert seen[-1] == 5


def test_two_different_crops_are_not_shared(model: MoondreamModel) -> None:
    # (cannot come from overlap_crops, whose 1x1 tile is always the global crop: the guard itself)
    rng = np.random.default_rng(3)
    size = model.cfg.vision.crop_size
    crops = rng.integers(0, 255, (2, size, size, 3), dtype=np.uint8)
    runner = _runner(model, (1, 2))
    seen = _spy(runner)
    got = np.asarray(runner.encode_image(crops, (1, 1)))
    want = np.asarray(model.vision(jnp.asarray(crops), (1, 1), jnp.float32))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert seen == [2]


def _images_runner(model: MoondreamModel, batches: tuple[int, ...]) -> Runner:
    return Runner(model, RunnerConfig(num_pages=8, kv_dtype="f32", max_seq_len=256, page_size=64,
                                      vision_buckets=(1, 13), vision_image_batches=batches, device_crops="on"),
                  out_rows=4)


def test_one_crop_images_are_encoded_together_and_equal_one_by_one(model: MoondreamModel) -> None:
    """Five one-crop images (host crops and device plans mixed) and a 2x2-tiled one: the one-crop
    images go in steps of at most 4 (4, then a lone one in the one-image step), each output equals
    encoding that image alone, in order, the tiled image keeps its own step."""
    rng = np.random.default_rng(5)
    vis = model.cfg.vision
    items: list[tuple[object, tuple[int, int]]] = []
    for k, shape in enumerate([(378, 378), (300, 340), (41, 377), (200, 200), (378, 300)]):
        img = rng.integers(0, 255, (*shape, 3), dtype=np.uint8)
        if k % 2:
            plan = plan_crops(img, vis, canvas=1024)
            assert plan is not None
            items.append((plan, (1, 1)))
        else:
            crops, tiling = overlap_crops(img, vis)
            items.append((crops, tiling))
    big = rng.integers(0, 255, (400, 400, 3), dtype=np.uint8)
    crops, tiling = overlap_crops(big, vis)
    assert tiling != (1, 1)
    items.insert(2, (crops, tiling))
    runner = _images_runner(model, (2, 4))
    # compiled as the warm-up does it (blank host crops): a group mixing host crops, crops made on
    # the device and blank padding finds that step (one jit signature), no second compile
    blank = np.zeros((1, vis.crop_size, vis.crop_size, 3), np.uint8)
    runner.encode_singles([blank] * 4)
    compiled = runner._vision_images._cache_size()  # type: ignore[attr-defined]
    seen = _spy(runner)
    got = [np.asarray(x) for x in runner.encode_images(items)]  # type: ignore[arg-type]
    assert runner._vision_images._cache_size() == compiled == 1  # type: ignore[attr-defined]
    assert sorted(seen) == [1, 13]  # four in one step; the fifth one-crop image alone; the tiled one in 13
    alone = _runner(model, (1, 13))
    for (c, t), g in zip(items, got, strict=True):
        want = np.asarray(alone.encode_image(c, t))  # type: ignore[arg-type]
        assert g.shape == want.shape
        np.testing.assert_allclose(g, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_a_group_of_three_is_padded_to_four_and_no_batches_means_one_by_one(model: MoondreamModel) -> None:
    rng = np.random.default_rng(6)
    imgs = [rng.integers(0, 255, (378, 378, 3), dtype=np.uint8) for _ in range(3)]
    items = [overlap_crops(img, model.cfg.vision) for img in imgs]
    runner = _images_runner(model, (2, 4))
    groups: list[int] = []
    batched = runner._vision_images

    def spy(params: object, crops: tuple[object, ...], rows: object, cols: object) -> object:
        groups.append(len(crops))
        return batched(params, crops, rows, cols)

    runner._vision_images = spy  # type: ignore[assignment]
    got = runner.encode_images(items)  # type: ignore[arg-type]
    assert groups == [4] and len(got) == 3
    plain = _images_runner(model, ())
    seen = _spy(plain)
    want = plain.encode_images(items)  # type: ignore[arg-type]
    assert seen == [1, 1, 1]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=1e-5 * np.abs(np.asarray(w)).max())
    with pytest.raises(ValueError, match="image counts >= 2"):
        _images_runner(model, (1, 4))


def test_pooling_weights_and_blank_crops_are_put_on_the_device_once(model: MoondreamModel) -> None:
    # Constant step inputs travel once: the same device arrays serve every call with the tiling
    # (a host array would be transferred, to a new address, at every call), and they hold what
    # tile_pool_matrices gives.
    import jax

    from kestrel_jax.models.vision import tile_pool_matrices

    runner = _runner(model, (1, 9))
    runner.image_batches = (2, 3)
    seen: list[tuple[object, ...]] = []
    vision, images = runner._vision, runner._vision_images

    def spy(params: object, batch: object, rows: object, cols: object) -> object:
        seen.append((rows, cols))
        return vision(params, batch, rows, cols)

    def spy_images(params: object, batch: tuple[object, ...], rows: object, cols: object) -> object:
        seen.append((rows, cols, *batch))
        return images(params, batch, rows, cols)

    runner._vision = spy  # type: ignore[assignment]
    runner._vision_images = spy_images  # type: ignore[assignment]
    rng = np.random.default_rng(5)
    crops, tiling = overlap_crops(rng.integers(0, 255, (400, 600, 3), dtype=np.uint8), model.cfg.vision)
    assert tiling == (2, 4) and crops.shape[0] == 9
    first = np.asarray(runner.encode_image(crops, tiling))
    again = np.asarray(runner.encode_image(crops, tiling))
    np.testing.assert_array_equal(first, again)
    assert seen[0][0] is seen[1][0] and seen[0][1] is seen[1][1]
    want = tile_pool_matrices(tiling, model.cfg.vision, 8)
    for got, ref in zip(seen[0][:2], want, strict=True):
        assert isinstance(got, jax.Array)
        np.testing.assert_array_equal(np.asarray(got), ref)
    one = rng.integers(0, 255, (1, 378, 378, 3), dtype=np.uint8)
    runner.encode_singles([one])  # pads to 2 with one blank crop
    runner.encode_singles([one])
    a, b = seen[2], seen[3]
    assert len(a) == 4 and a[0] is b[0] and a[1] is b[1] and a[3] is b[3]  # same weights, same blank crop
    assert not np.asarray(a[3]).any()
