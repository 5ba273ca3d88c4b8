"""The residual + LayerNorm kernel over blocks of rows (`layer_norm_blocks`): interpreted on the CPU
against the model's expressions (each add rounded to x's dtype, then `layers.layer_norm`) for
ragged row counts, widths that are not powers of two (the vision encoder's 1152), zero to two
addends and f32 / bf16; its shape checks; the dispatch in `ops.residual_layer_norm`; its lowering
at the vision encoder's and the text prefill's shapes; and the vision encoder with it interpreted
inside, against the jnp path (the runner's prefill + mixed steps: tests/models/test_prefill_qkv_path.py).

Bounds: x' is formed with the model's roundings, so it must be bit-identical. LN(x') reduces its
sums in the kernel's order, not XLA's: within one step of x's dtype at the output's magnitude."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType
from kernel_helpers import as_f32, fresh_rng

from kestrel_jax.models import vision
from kestrel_jax.models.config import tiny_config
from kestrel_jax.models.moondream import random_model
from kestrel_jax.pallas import layer_norm_blocks as L
from kestrel_jax.pallas import ops

BF16 = jnp.bfloat16
_SDS = jax.ShapeDtypeStruct


def _case(rng: np.random.Generator, T: int, D: int, n_adds: int, dtype: Any):
    # an offset mean and a large spread (the one-pass variance's cancellation), and an outlier
    x = rng.standard_normal((T, D)) * 3.0 + 5.0
    x[0, min(7, D - 1)] = 3000.0
    adds = tuple(jnp.asarray(rng.standard_normal((T, D)) * 2.0, dtype) for _ in range(n_adds))
    scale = jnp.asarray(rng.uniform(0.5, 1.5, D), dtype)
    bias = jnp.asarray(rng.standard_normal(D) * 0.1, dtype)
    return jnp.asarray(x, dtype), adds, scale, bias


def _check(got: tuple[jax.Array, jax.Array], ref: tuple[jax.Array, jax.Array], dtype: Any) -> None:
    np.testing.assert_array_equal(as_f32(got[0]), as_f32(ref[0]))
    n, nr = as_f32(got[1]), as_f32(ref[1])
    assert np.isfinite(n).all()
    step = 2.0**-7 if dtype == BF16 else 2.0**-20
    np.testing.assert_allclose(n, nr, rtol=step, atol=step * np.abs(nr).max())


@pytest.mark.parametrize("T,D,n_adds,dtype,block_rows", [
    (13, 1152, 1, BF16, 4),  # the vision encoder's width, rows past the last block masked
    (9, 256, 2, BF16, 4),  # the text model's parallel block: (x + a) + m
    (5, 48, 0, jnp.float32, 2),  # a first LayerNorm (no residual), f32, width 48 in 64 lanes
    (8, 128, 2, jnp.float32, 8),
    (3, 256, 1, BF16, 1),
])
def test_kernel_matches_the_model_expressions(T, D, n_adds, dtype, block_rows):
    rng = fresh_rng()
    x, adds, scale, bias = _case(rng, T, D, n_adds, dtype)
    got = L.residual_layer_norm_blocks_kernel(x, adds, scale, bias, eps=1e-5, block_rows=block_rows, interpret=True)
    ref = L.residual_layer_norm_blocks_ref(x, adds, scale, bias, eps=1e-5)
    _check(got, ref, dtype)
    assert got[0].dtype == got[1].dtype == dtype and got[1].shape == (T, D)


def test_fresh_draws_agree_each_time():
    rng = fresh_rng()
    for _ in range(3):
        T, D = int(rng.integers(1, 20)), int(rng.choice([48, 96, 160, 256]))
        x, adds, scale, bias = _case(rng, T, D, int(rng.integers(0, 3)), BF16)
        _check(L.residual_layer_norm_blocks_kernel(x, adds, scale, bias, eps=1e-5, interpret=True),
               L.residual_layer_norm_blocks_ref(x, adds, scale, bias, eps=1e-5), BF16)


def test_shape_checks():
    x = jnp.zeros((4, 64), BF16)
    s = jnp.ones((64,), BF16)

    def ok(*args: Any, **kwargs: Any) -> str:
        return str(L.residual_layer_norm_blocks_problem(*args, **kwargs))

    assert L.residual_layer_norm_blocks_problem(x, (x, x), s, s) is None
    assert "[rows, D]" in ok(jnp.zeros((2, 4, 64), BF16), (), s, s)
    assert "at most 2" in ok(x, (x, x, x), s, s)
    assert "must match x" in ok(x, (jnp.zeros((4, 64), jnp.float32),), s, s)
    assert "must match x" in ok(x, (jnp.zeros((3, 64), BF16),), s, s)
    assert "must be [64]" in ok(x, (), jnp.ones((32,), BF16), s)
    assert "power of two" in ok(x, (), s, s, block_rows=3)
    assert "too large" in ok(jnp.zeros((4, 8192), BF16), (), jnp.ones((8192,), BF16), jnp.ones((8192,), BF16), 4)
    # rows per program by default: 2 at power-of-two widths, 1 where lanes are masked (measured)
    assert [L.default_block_rows(d) for d in (2048, 1152, 64, 48)] == [2, 1, 2, 1]
    assert "bf16 or f32" in ok(x.astype(jnp.float16), (), s.astype(jnp.float16), s.astype(jnp.float16))
    with pytest.raises(ValueError, match="residual_layer_norm_blocks_kernel: at most 2"):
        L.residual_layer_norm_blocks_kernel(x, (x, x, x), s, s, eps=1e-5, interpret=True)


def test_dispatch(monkeypatch: pytest.MonkeyPatch):
    rng = fresh_rng()
    x, adds, scale, bias = _case(rng, 6, 64, 2, BF16)
    x3, adds3 = x.reshape(2, 3, 64), tuple(a.reshape(2, 3, 64) for a in adds)
    ref = L.residual_layer_norm_blocks_ref(x3, adds3, scale, bias, eps=1e-5)
    # on the CPU: the model's expressions themselves
    got = ops.residual_layer_norm(x3, adds3, scale, bias, eps=1e-5)
    for g, r in zip(got, ref, strict=True):
        np.testing.assert_array_equal(as_f32(g), as_f32(r))
    # the kernel path: leading axes folded into rows and back, block rows and warps from the switches
    seen: list[dict[str, Any]] = []

    def spy(x2, adds2, s, b, **kw):
        seen.append({"shape": x2.shape, "adds": len(adds2), **kw})
        return L.residual_layer_norm_blocks_kernel(x2, adds2, s, b, eps=kw["eps"], block_rows=kw["block_rows"],
                                                   interpret=True)

    monkeypatch.setattr(ops, "_jitted", lambda fn, static=(): spy)
    with ops.use_backend("kernel"):
        ops.residual_layer_norm(x3[..., :48], tuple(a[..., :48] for a in adds3), scale[:48], bias[:48], eps=1e-5)
        assert seen.pop() == {"shape": (6, 48), "adds": 2, "eps": 1e-5, "block_rows": 1, "num_warps": L.NUM_WARPS}
        monkeypatch.setenv("KESTREL_JAX_BLOCK_LN_ROWS", "4")
        got = ops.residual_layer_norm(x3, adds3, scale, bias, eps=1e-5)
        assert seen == [{"shape": (6, 64), "adds": 2, "eps": 1e-5, "block_rows": 4, "num_warps": L.NUM_WARPS}]
        assert got[0].shape == got[1].shape == (2, 3, 64)
        _check((got[0].reshape(6, 64), got[1].reshape(6, 64)), (ref[0].reshape(6, 64), ref[1].reshape(6, 64)), BF16)
        monkeypatch.setenv("KESTREL_JAX_BLOCK_LN", "0")  # the benchmarks' A/B switch: XLA's launches
        ops.residual_layer_norm(x3, adds3, scale, bias, eps=1e-5)
        monkeypatch.setenv("KESTREL_JAX_BLOCK_LN", "1")
        monkeypatch.delenv("KESTREL_JAX_BLOCK_LN_ROWS")
        ops.residual_layer_norm(jnp.zeros((4, 32768), BF16), (), jnp.ones((32768,), BF16), jnp.ones((32768,), BF16),
                                eps=1e-5)  # a shape the kernel does not take: the jnp path
    assert len(seen) == 1
    monkeypatch.setenv("KESTREL_JAX_BLOCK_LN_ROWS", "3")  # refused by the kernel: named, not a silent XLA run
    with ops.use_backend("kernel"), pytest.raises(ValueError, match="KESTREL_JAX_BLOCK_LN_ROWS=3"):
        ops.residual_layer_norm(x3, adds3, scale, bias, eps=1e-5)


def test_lowers_at_vision_and_prefill_shapes():
    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    for T, D, n_adds in [(4 * 729, 1152, 1), (729, 1152, 0), (1600, 2048, 2)]:
        def f(x, adds, s, b):
            return L.residual_layer_norm_blocks_kernel(x, adds, s, b, eps=1e-5)
        with jax.sharding.use_abstract_mesh(mesh):
            text = jax.jit(f).trace(_SDS((T, D), BF16), tuple(_SDS((T, D), BF16) for _ in range(n_adds)),
                                    _SDS((D,), BF16), _SDS((D,), BF16)).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text


def interpret_residual_layer_norm(monkeypatch: pytest.MonkeyPatch, calls: list[int]) -> None:
    """`ops.residual_layer_norm` through the kernel, interpreted (the other ops stay on jnp);
    `calls` counts the kernel's runs (not the op's: a refused shape would take the jnp path)."""
    original = ops.residual_layer_norm

    def interpreted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return L.residual_layer_norm_blocks_kernel(*args, interpret=True, **kwargs)

    def forced(*args: Any, **kwargs: Any) -> Any:
        with ops.use_backend("kernel"), monkeypatch.context() as m:
            m.setattr(ops, "_jitted", lambda fn, static=(): interpreted)
            return original(*args, **kwargs)

    monkeypatch.setattr(ops, "residual_layer_norm", forced)


def test_vision_encoder_through_the_kernel(monkeypatch: pytest.MonkeyPatch):
    model = random_model(tiny_config("md2", vision_layers=2), dtype=BF16, seed=5)
    crops = jnp.asarray(fresh_rng().integers(0, 256, (2, 378, 378, 3)), jnp.uint8)
    ref = as_f32(model.vision.encode_crops(crops, BF16))
    # the jnp path is the blocks' own expressions (`VisionBlock.__call__`), chained
    enc = model.vision
    x = enc.patch_emb(vision.patchify(vision.normalize_crops(crops, BF16), enc.cfg.enc_patch_size))
    x = x + enc.pos_emb[...].astype(BF16)
    for block in enc.blocks:
        x = block(x)
    np.testing.assert_array_equal(as_f32(enc.post_ln(x)), ref)
    calls = [0]
    interpret_residual_layer_norm(monkeypatch, calls)
    got = as_f32(model.vision.encode_crops(crops, BF16))
    assert calls[0] == 1 + 2 * 2  # the first LayerNorm, then two per block (the last is post_ln)
    np.testing.assert_allclose(got, ref, rtol=2.0**-6, atol=2.0**-6 * np.abs(ref).max())
