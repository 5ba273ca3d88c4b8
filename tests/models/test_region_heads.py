"""The region heads on the decode GEMM kernel's path (few rows on a GPU) give the products of the
reference path: MD3's two decoders from one paired launch, the two encoders each from one launch,
and the jnp path wherever the kernel does not apply (more rows than the threshold, MD2's MLP
decoders). The kernel's own numerics are tested in tests/pallas/test_gemv.py; here its split
partials come from an exact f32 stand-in so that what is tested is the plumbing (pairing, bias,
row padding, the size decoder's [N, 2, bins] reshape)."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kestrel_jax.models.config import tiny_config
from kestrel_jax.models.layers import MLP, Linear
from kestrel_jax.models.region import RegionModel
from kestrel_jax.pallas import gemv_mgpu, ops


@pytest.fixture()
def launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Stand in for the kernel (interpret mode is too slow for these widths); records each launch's
    (rows, K, N)."""
    seen: list[tuple[int, ...]] = []

    def partials(x, w, w2=None, gate=None, **_):  # [2, N, Mp] f32 partials of y^T, K split in two
        ww = w if w2 is None else jnp.concatenate([w, w2], axis=1)
        seen.append((x.shape[0], *ww.shape))
        mp = -(-x.shape[0] // 8) * 8
        xp = jnp.pad(x, ((0, mp - x.shape[0]), (0, 0))).astype(jnp.float32)
        h = x.shape[1] // 2
        out = jnp.stack([(xp[:, :h] @ ww[:h].astype(jnp.float32)).T, (xp[:, h:] @ ww[h:].astype(jnp.float32)).T])
        return out if gate is None else jnp.where(gate.table[gate.row, gate.column] != 0, out, 0.0)  # the kernel's gate

    monkeypatch.setattr(gemv_mgpu, "gemv_partials", partials)
    monkeypatch.setattr(gemv_mgpu, "gemv_supported", lambda x, w: x.shape[0] <= 64)
    # the kernel entry points' traces are cached per function by jax.jit (another test may have
    # traced `gemv` at these shapes with its own stand-in): every cache goes
    ops._jitted.cache_clear()
    jax.clear_caches()
    return seen


def _close(a: jax.Array, b: jax.Array) -> None:
    a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a32.shape == b32.shape
    # bf16 products: the stand-in accumulates in f32 as XLA's CPU dot does, in another order
    np.testing.assert_allclose(a32, b32, rtol=2e-2, atol=2e-2 * float(np.abs(b32).max()))


def _region(family: Literal["md2", "md3"]) -> RegionModel:  # the region heads alone (a whole model takes seconds)
    return RegionModel(tiny_config(family).region, dtype=jnp.bfloat16, rngs=nnx.Rngs(3))


@pytest.fixture(scope="module")
def md3_region() -> RegionModel:
    region = _region("md3")
    rng = np.random.default_rng()
    for lin in (region.coord_decoder, region.size_decoder, region.coord_encoder, region.size_encoder):
        assert isinstance(lin, Linear) and lin.bias is not None  # zeros at random init: make them matter
        lin.bias[...] = jnp.asarray(rng.standard_normal(lin.bias.shape), jnp.bfloat16)
    return region


@pytest.mark.parametrize("rows", [1, 5])
def test_md3_region_heads_on_the_kernel_path(launches: list[tuple[int, ...]], md3_region: RegionModel,
                                             rows: int) -> None:
    region = md3_region
    rng = np.random.default_rng()
    h = jnp.asarray(rng.standard_normal((rows, region.cfg.dim)), jnp.bfloat16)
    v = jnp.asarray(rng.uniform(size=(rows, 2)), jnp.float32)
    with ops.use_backend("kernel"):
        coord, size = jax.jit(lambda h: region.decode_heads(h, kernel_rows=8))(h)
        ec = region.encode_coordinate(v[:, :1], jnp.bfloat16, kernel_rows=8)
        es = region.encode_size(v, jnp.bfloat16, kernel_rows=8)
    d = region.cfg.dim
    assert launches == [(rows, d, region.cfg.coord_out_dim + region.cfg.size_out_dim),
                        (rows, region.cfg.coord_feat_dim, d), (rows, region.cfg.size_feat_dim, d)]
    with ops.use_backend("reference"):
        _close(coord, region.decode_coordinate(h))
        _close(size, region.decode_size(h))
        _close(ec, region.encode_coordinate(v[:, :1], jnp.bfloat16))
        _close(es, region.encode_size(v, jnp.bfloat16))
    assert coord.dtype == jnp.float32 and size.shape == (rows, 2, region.cfg.size_out_dim // 2)


def test_region_heads_keep_the_jnp_path_past_the_threshold_and_for_mlps(launches: list[tuple[int, ...]],
                                                                        md3_region: RegionModel) -> None:
    md3 = md3_region
    md2 = _region("md2")
    h9 = jnp.ones((9, md3.cfg.dim), jnp.bfloat16)
    with ops.use_backend("kernel"):
        coord, _ = md3.decode_heads(h9, kernel_rows=8)
        md3.encode_size(jnp.full((9, 2), 0.5), jnp.bfloat16, kernel_rows=8)
        md2.decode_heads(jnp.ones((1, md2.cfg.dim), jnp.bfloat16), kernel_rows=8)  # MLP decoders
        md3.decode_heads(h9[:1], kernel_rows=0)  # the switch off
    assert launches == []
    with ops.use_backend("reference"):
        np.testing.assert_array_equal(np.asarray(coord), np.asarray(md3.decode_coordinate(h9)))


def test_the_gpu_check_tool_compares_both_paths(launches: list[tuple[int, ...]], md3_region: RegionModel) -> None:
    """tools/check_region_heads.py's comparison, here with the kernel's stand-in: every head within
    bf16 rounding of XLA's, and the decoders' product came from the paired launch."""
    from tools.check_region_heads import compare

    with ops.use_backend("kernel"):
        res = compare(md3_region, 2)
    assert (2, md3_region.cfg.dim, md3_region.cfg.coord_out_dim + md3_region.cfg.size_out_dim) in launches
    for name in ("coord", "size", "enc_coord", "enc_size"):
        assert res[name]["finite"] and res[name]["max_rel"] <= 2e-2, (name, res[name])
    assert 0.0 <= res["coord"]["argmax_agree"] <= 1.0


@pytest.mark.parametrize("family", ["md3", "md2"])
def test_the_gpu_check_tool_compares_the_gated_paths(launches: list[tuple[int, ...]],
                                                     family: Literal["md2", "md3"]) -> None:
    """tools/check_region_heads.py --gate with the kernel's stand-in: open, the heads match XLA's;
    closed, they match XLA's on the heads with their kernels zeroed. Where the gate is ignored
    (the reference path), the closed comparison fails."""
    from tools.check_region_heads import compare

    region = _region(family)
    for lin in (region.coord_decoder, region.coord_encoder):  # zeros at random init: make them matter
        last = lin if isinstance(lin, Linear) else lin.fc2
        assert last.bias is not None
        last.bias[...] = jnp.asarray(np.random.default_rng(4).standard_normal(last.bias.shape), jnp.bfloat16)
    with ops.use_backend("kernel"):
        res = compare(region, 2, gate=True)
    for name in ("coord", "size", "enc_coord", "enc_size"):
        assert res["open"][name]["max_rel"] <= 2e-2, (name, res["open"][name])
        assert res["closed"][name]["max_rel"] <= 2e-2, (name, res["closed"][name])
    with ops.use_backend("reference"):  # the gate does not apply: products where zeros are expected
        ignored = compare(region, 2, gate=True)
    assert ignored["closed"]["coord"]["max_rel"] > 2e-2 and ignored["closed"]["enc_coord"]["max_rel"] > 2e-2


@pytest.mark.parametrize("family", ["md3", "md2"])
def test_region_gate_skips_the_products_unless_a_row_needs_them(launches: list[tuple[int, ...]],
                                                                md3_region: RegionModel, family: str) -> None:
    """With a gate (`ops.region_gate_wanted`: the step's "any row needs the region heads" column)
    the heads' decode GEMMs, MD2's decoder MLPs included, take it: set, the heads are the reference
    path's; clear, every product is skipped and each head is its last layer's bias."""
    region = md3_region if family == "md3" else _region("md2")
    if family == "md2":
        rng0 = np.random.default_rng(1)
        for mlp in (region.coord_decoder, region.size_decoder):
            assert isinstance(mlp, MLP)
            for lin in (mlp.fc1, mlp.fc2):  # zeros at random init: make them matter
                assert lin.bias is not None
                lin.bias[...] = jnp.asarray(rng0.standard_normal(lin.bias.shape), jnp.bfloat16)
    rng = np.random.default_rng()
    h = jnp.asarray(rng.standard_normal((2, region.cfg.dim)), jnp.bfloat16)
    v = jnp.asarray(rng.uniform(size=(2, 2)), jnp.float32)
    for on in (1, 0):
        gate = ops.gate(jnp.zeros((3, 5), jnp.int32).at[0, 4].set(on), 0, 4)
        launches.clear()
        with ops.use_backend("kernel"):
            coord, size = region.decode_heads(h, kernel_rows=8, gate=gate)
            ec = region.encode_coordinate(v[:, :1], jnp.bfloat16, kernel_rows=8, gate=gate)
        if on:  # traced once per shape (the second pass reuses the traces): MD3 the pair and the
            # encoder; MD2 the decoders' fc1 (one shape for both, as the encoder's), and their fc2s
            assert len(set(launches)) == (2 if family == "md3" else 3), launches
        last = region.coord_decoder if isinstance(region.coord_decoder, Linear) else region.coord_decoder.fc2
        assert last.bias is not None and region.coord_encoder.bias is not None
        if on:
            with ops.use_backend("reference"):
                _close(coord, region.decode_coordinate(h))
                _close(size, region.decode_size(h))
                _close(ec, region.encode_coordinate(v[:, :1], jnp.bfloat16))
        else:
            bias = np.asarray(last.bias[...], np.float32)
            np.testing.assert_array_equal(np.asarray(coord), np.broadcast_to(bias, coord.shape))
            enc_bias = np.asarray(region.coord_encoder.bias[...], np.float32)
            np.testing.assert_array_equal(np.asarray(ec, np.float32), np.broadcast_to(enc_bias, ec.shape))


def test_heads_barrier_switch(launches: list[tuple[int, ...]], md3_region: RegionModel,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    """KESTREL_JAX_HEADS_BARRIER=1: the kernel path's head logits pass an optimization barrier
    (XLA then cannot fuse the split-partial sum into the argmax); the values are the same."""
    h = jnp.asarray(np.random.default_rng(2).standard_normal((1, md3_region.cfg.dim)), jnp.bfloat16)
    out = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("KESTREL_JAX_HEADS_BARRIER", switch)
        ops._jitted.cache_clear()
        with ops.use_backend("kernel"):
            f = jax.jit(lambda h: md3_region.decode_heads(h, kernel_rows=8))
            text = f.lower(h).as_text()
            out[switch] = [np.asarray(a) for a in f(h)]
        assert ("optimization_barrier" in text) == (switch == "1"), switch
        with ops.use_backend("reference"):  # never on the reference path
            assert "optimization_barrier" not in jax.jit(lambda h: md3_region.decode_heads(h)).lower(h).as_text()
    for a, b in zip(out["0"], out["1"], strict=True):
        np.testing.assert_array_equal(a, b)
