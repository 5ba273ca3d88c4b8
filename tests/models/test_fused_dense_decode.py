"""Dense layers' decode QKV + fc1, and output projection + fc2, each as one product over weights
joined at load time (`TextModel.fuse_dense_decode`, `RunnerConfig.fused_dense_decode`): the
runner's decode steps give the same outputs as with the separate weights (the input product's
columns are the two GEMMs' columns: bit-identical; the output product rounds the sum of its two
terms once: within bf16 rounding, the same tokens; a one-row step forms fc1 on its own and the
output product over the joined weights), the joined weights are the separate ones side by side /
stacked, MoE layers get none, prefill keeps the separate ones, runners started at once on one
model all get them, and a bad setting is refused."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kestrel_jax.models.config import MoondreamConfig, tiny_config
from kestrel_jax.models.layers import gelu_tanh
from kestrel_jax.models.moondream import random_model
from kestrel_jax.models.text import MLP
from kestrel_jax.pallas import ops
from kestrel_jax.serving import batch as bt
from kestrel_jax.serving.runner import Runner, RunnerConfig

PAGE = 16
# Text layers of the models below: tiny_config's four, less the layers that only repeat others (the
# steps' programs, their compile time and the interpreted kernels' traces grow with the layers): two
# dense layers for MD2, two dense and one MoE layer (MoE from layer 2, as in tiny_config) for MD3.
LAYERS = {"md2": 2, "md3": 3}


def _config(family: Literal["md2", "md3"]) -> MoondreamConfig:
    cfg = tiny_config(family, vision_layers=2)
    return dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, n_layers=LAYERS[family])).validate()


def _steps(family: Literal["md2", "md3"], fused: str, bucket: int = 2) -> tuple[list[np.ndarray], Runner]:
    model = random_model(_config(family), dtype=jnp.bfloat16, seed=3)
    r = Runner(model, RunnerConfig(num_pages=16, kv_dtype="bf16", max_seq_len=128, page_size=PAGE,
                                   vision_buckets=(2,), fused_dense_decode=fused), out_rows=max(8, bucket))
    p = r.max_pages_per_seq
    a, b = [1, 700, 33, 4000, 12, 9, 81, 5], [1, 55, 66, 77, 88]
    pre = bt.text_prefill([(2, a), (6, b)], tokens=32, max_seqs=2, pages=p, page_size=PAGE)
    out = [np.asarray(r.prefill(*pre, jnp.zeros((1, 728, model.cfg.text.dim), model.dtype)))]
    rows = [[2, len(a), int(out[0][0, 0])], [6, len(b), int(out[0][1, 0])]][:bucket]  # bucket 1: one decodes
    for _ in range(3):
        dec = bt.text_decode([(s, n, tok, -1) for s, n, tok in rows], bucket=bucket, pages=p, page_size=PAGE)
        out.append(np.asarray(r.decode(*dec, None)[1]))
        for j, row in enumerate(rows):
            row[1], row[2] = row[1] + 1, int(out[-1][j, 0])
    out += [np.asarray(x.astype(jnp.float32)) for x in (*r.cache.k, *r.cache.v)]
    return out, r


@functools.cache
def _separate(family: Literal["md2", "md3"]) -> tuple[list[np.ndarray], Runner]:
    """The steps over the separate weights (the reference of the tests below)."""
    return _steps(family, "off")


def _switches() -> tuple[tuple[str, str], ...]:
    """The KESTREL_JAX_* switches set now (they pick kernels and products at trace time)."""
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("KESTREL_JAX_")))


@functools.cache
def _joined_steps(family: Literal["md2", "md3"], bucket: int, switches: tuple[tuple[str, str], ...]
                  ) -> tuple[list[np.ndarray], Runner, list[int]]:
    """`_steps(family, "on", bucket)` under `switches` (the environment's, as `_switches()` gives
    them) with nothing patched: XLA's joined products, the reference several tests compare a
    kernel path against (run once per file, not once per test). Also returns the rows of each
    joined output product traced (`Block.dense_decode_out`)."""
    from kestrel_jax.models.text import Block

    assert switches == _switches()
    assert not _patched(), "the cached reference runs unpatched ops"
    seen: list[int] = []
    original = Block.dense_decode_out

    def counted(self: Block, o: jax.Array, h: jax.Array) -> jax.Array:
        seen.append(o.shape[0])
        return original(self, o, h)

    Block.dense_decode_out = counted  # type: ignore[method-assign]
    try:
        out, runner = _steps(family, "on", bucket)
    finally:
        Block.dense_decode_out = original  # type: ignore[method-assign]
    return out, runner, seen


_OPS = {name: getattr(ops, name) for name in ("small_linear", "decode_qkv", "decode_dense_layer_norm")}


def _patched() -> bool:
    """Whether a test routed one of the ops below through an interpreted kernel (`_route_through`)."""
    return any(getattr(ops, name) is not fn for name, fn in _OPS.items())


def _decode_refuses(family: Literal["md2", "md3"], bucket: int, match: str) -> None:
    """A decode step of a fresh runner (as `_steps` makes it; no prefill before it: the refusal is
    the decode step's, at trace time) raises ValueError matching `match`."""
    model = random_model(_config(family), dtype=jnp.bfloat16, seed=3)
    r = Runner(model, RunnerConfig(num_pages=16, kv_dtype="bf16", max_seq_len=128, page_size=PAGE,
                                   vision_buckets=(2,), fused_dense_decode="on"), out_rows=max(8, bucket))
    dec = bt.text_decode([(2, 8, 5, -1)], bucket=bucket, pages=r.max_pages_per_seq, page_size=PAGE)
    with pytest.raises(ValueError, match=match):
        r.decode(*dec, None)


def _route_through(monkeypatch: pytest.MonkeyPatch, op: str, module: Any, kernel: str,
                   interpreted: Callable[..., Any], when: Callable[[dict[str, Any]], bool] = lambda kw: True) -> None:
    """`ops.<op>` runs on the kernel backend with `module.<kernel>` replaced by `interpreted` (the
    other ops stay on jnp); a call whose keyword arguments `when` refuses gets None (the caller's jnp
    product, as on the CPU)."""
    original = getattr(ops, op)

    def forced(*args: Any, **kwargs: Any) -> Any:
        if not when(kwargs):
            return None
        with ops.use_backend("kernel"), monkeypatch.context() as m:
            m.setattr(module, kernel, interpreted)
            out = original(*args, **kwargs)
        assert out is not None
        return out

    monkeypatch.setattr(ops, op, forced)


def _gemv_through_kernel(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int | None, int, bool]]:
    """`ops.small_linear` calls that ask for K splits (the dense layers' joined products) run the
    decode GEMM kernel, interpreted; the others (the region heads') get None, jnp as on the CPU.
    Returns the list recording each traced call's (rows, K, splits, ring stages, row-major)."""
    from kestrel_jax.pallas import gemv_mgpu as g

    calls: list[tuple[int, int, int | None, int, bool]] = []
    kernel = g.gemv

    def interpreted(x: jax.Array, w: jax.Array, *args: Any, **kwargs: Any) -> Any:
        calls.append((x.shape[0], w.shape[0], kwargs.get("splits"), kwargs.get("stages", 4),
                      kwargs.get("row_major", False)))
        return kernel(x, w, *args, interpret=True, **kwargs)

    _route_through(monkeypatch, "small_linear", g, "gemv", interpreted, when=lambda kw: kw.get("splits") is not None)
    return calls


def _count_joined_output_products(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The list recording the rows of each joined output product traced (`Block.dense_decode_out`)."""
    from kestrel_jax.models.text import Block

    seen: list[int] = []
    original = Block.dense_decode_out

    def counted(self: Block, o: jax.Array, h: jax.Array) -> jax.Array:
        seen.append(o.shape[0])
        return original(self, o, h)

    monkeypatch.setattr(Block, "dense_decode_out", counted)
    return seen


def _assert_same_tokens(got: list[np.ndarray], ref: list[np.ndarray]) -> None:
    """The steps' sampled tokens equal; outputs and KV within bf16 rounding."""
    for x, y in zip(got[:4], ref[:4], strict=True):
        np.testing.assert_array_equal(x[:, 0], y[:, 0])  # sampled tokens
    for x, y in zip(got, ref, strict=True):
        np.testing.assert_allclose(x, y, rtol=2.0**-6, atol=2.0**-6 * np.abs(y).max())


def _dense_layers(family: str) -> int:
    return LAYERS[family] if family == "md2" else 2  # MD3: MoE from layer 2


@pytest.mark.parametrize("family", ["md2", "md3"])
def test_decode_through_joined_weights_equals_separate(family: Literal["md2", "md3"],
                                                       monkeypatch: pytest.MonkeyPatch):
    """The QKV + fc1 product alone (KESTREL_JAX_DENSE_OUT_JOINED=0): bit-identical steps."""
    from kestrel_jax.models.text import Block

    monkeypatch.setenv("KESTREL_JAX_DENSE_OUT_JOINED", "0")
    ref, r_off = _separate(family)
    seen: list[int] = []  # rows of each joined product traced
    original = Block.dense_decode_in

    def counted(self: Block, n: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array] | None:
        out = original(self, n)
        if out is not None:
            seen.append(n.shape[0])
        return out

    monkeypatch.setattr(Block, "dense_decode_in", counted)
    got, r_on = _steps(family, "on")
    for x, y in zip(got, ref, strict=True):
        np.testing.assert_array_equal(x, y)
    # the 2-row decode step's dense layers took the joined product; a 1-row step too, its QKV
    # epilogue reading it in place (`ops.dense_in_one_row`, on by default)
    traced = len(seen)
    assert traced and set(seen) == {2}
    r_on.decode(*bt.text_decode([(2, 20, 7, -1)], bucket=1, pages=r_on.max_pages_per_seq, page_size=PAGE), None)
    assert seen[traced:] == [1] * _dense_layers(family)
    per_layer = 2 * 256 * (3 * 256 + 512) + 2 * (3 * 256 + 512)  # bf16 [D, QKV + F] and its bias
    dense = _dense_layers(family)
    assert r_on.joined_dense_bytes == dense * per_layer and r_off.joined_dense_bytes == 0
    assert len(r_on.lm_params) == len(r_off.lm_params) + 2 * dense
    # the runners' params hold them; the models keep none
    assert all(b.dense_w is None and b.dense_b is None for r in (r_on, r_off) for b in r.model.text.blocks)


@pytest.mark.parametrize("family", ["md2", "md3"])
def test_decode_through_joined_output_weights(family: Literal["md2", "md3"], monkeypatch: pytest.MonkeyPatch):
    """With the output projection + fc2 product as well (the default): the same sampled tokens,
    logprobs, region outputs and KV within bf16 rounding of the separate products' sum."""
    ref, r_off = _separate(family)
    got, r_on, seen = _joined_steps(family, 2, _switches())
    dense = _dense_layers(family)
    assert seen and len(seen) % dense == 0 and set(seen) == {2}  # the 2-row steps' dense layers
    _assert_same_tokens(got, ref)
    per_layer = 2 * 256 * (3 * 256 + 512) + 2 * (3 * 256 + 512) + 2 * (256 + 512) * 256 + 2 * 256
    assert r_on.joined_dense_bytes == dense * per_layer
    assert len(r_on.lm_params) == len(r_off.lm_params) + 4 * dense


def test_joined_weights_are_the_two_side_by_side():
    model = random_model(_config("md3"), dtype=jnp.bfloat16, seed=3)
    assert model.text.fuse_dense_decode() > 0
    blocks = model.text.blocks
    assert all(b.dense_w is None for b in blocks if not isinstance(b.mlp, MLP))  # MoE layers: none
    for b in blocks:
        if isinstance(b.mlp, MLP):
            assert b.dense_w is not None and b.dense_b is not None
            np.testing.assert_array_equal(np.asarray(b.dense_w[...]), np.concatenate(
                [np.asarray(b.attn.qkv.kernel[...]), np.asarray(b.mlp.fc1.kernel[...])], axis=1))
            qb, fb = b.attn.qkv.bias, b.mlp.fc1.bias
            assert qb is not None and fb is not None
            np.testing.assert_array_equal(np.asarray(b.dense_b[...]),
                                          np.concatenate([np.asarray(qb[...]), np.asarray(fb[...])]))
            # the output weights stacked, [proj; fc2], and their biases summed
            assert b.dense_out_w is not None and b.dense_out_b is not None
            np.testing.assert_array_equal(np.asarray(b.dense_out_w[...]), np.concatenate(
                [np.asarray(b.attn.proj.kernel[...]), np.asarray(b.mlp.fc2.kernel[...])], axis=0))
            pb, f2b = b.attn.proj.bias, b.mlp.fc2.bias
            assert pb is not None and f2b is not None
            np.testing.assert_array_equal(np.asarray(b.dense_out_b[...]), np.asarray(
                (pb[...].astype(jnp.float32) + f2b[...].astype(jnp.float32)).astype(jnp.bfloat16)))
    assert model.text.fuse_dense_decode(False) == 0
    assert all(b.dense_w is None and b.dense_b is None and b.dense_out_w is None for b in blocks)


def test_joined_output_product_is_projection_plus_fc2(monkeypatch: pytest.MonkeyPatch):
    """Block.dense_decode_out in float32: proj(o) + fc2(GELU_tanh(h)); none with the switch off."""
    model = random_model(_config("md2"), dtype=jnp.float32, seed=4)
    b = model.text.blocks[1]
    assert isinstance(b.mlp, MLP) and b.attn.proj.bias is not None and b.mlp.fc2.bias is not None
    keys = jax.random.split(jax.random.key(int(np.random.default_rng().integers(1 << 30))), 4)
    b.attn.proj.bias[...] = jax.random.normal(keys[2], (256,), jnp.float32)  # (random_model's are 0)
    b.mlp.fc2.bias[...] = jax.random.normal(keys[3], (256,), jnp.float32)
    model.text.fuse_dense_decode()
    o = jax.random.normal(keys[0], (5, 256), jnp.float32)
    h = jax.random.normal(keys[1], (5, 512), jnp.float32)
    want = b.attn.proj(o) + b.mlp.fc2(gelu_tanh(h))
    np.testing.assert_allclose(np.asarray(b.dense_decode_out(o, h)), np.asarray(want), rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("KESTREL_JAX_DENSE_OUT_JOINED", "0")
    model.text.fuse_dense_decode()
    assert all(x.dense_w is not None and x.dense_out_w is None for x in model.text.blocks)


def test_decode_qkv_kernel_reads_the_joined_product(monkeypatch: pytest.MonkeyPatch):
    """KESTREL_JAX_DECODE_QKV_WIDE=1: the decode QKV epilogue kernel (interpreted here, the other ops
    on jnp) reads the QKV columns of the joined product in place of their slice; the steps' outputs
    are those of the jnp path within bf16 rounding (the kernel rounds as the jnp path does, but
    its sin/cos and the KV write differ in the last bits), the sampled tokens equal."""
    from kestrel_jax.pallas import qkv_epilogue as qe

    ref, _, _ = _joined_steps("md2", 2, _switches())
    widths: list[int] = []
    kernel = qe.decode_qkv_kernel

    def interpreted(u: jax.Array, *args: Any, **kwargs: Any) -> Any:
        widths.append(u.shape[1])
        return kernel(u, *args, interpret=True, **kwargs)

    _route_through(monkeypatch, "decode_qkv", qe, "decode_qkv_kernel", interpreted)
    monkeypatch.setenv("KESTREL_JAX_DECODE_QKV_WIDE", "1")
    got, _ = _steps("md2", "on")
    # the 2-row decode step's dense layers (per trace): always the joined product's width
    assert widths and len(widths) % _dense_layers("md2") == 0 and set(widths) == {3 * 256 + 512}
    _assert_same_tokens(got, ref)


@pytest.mark.parametrize("family", ["md2", "md3"])
def test_one_row_joined_input_product(family: Literal["md2", "md3"], monkeypatch: pytest.MonkeyPatch):
    """KESTREL_JAX_DENSE_IN_ONE_ROW: a one-row decode step also forms each dense layer's QKV and fc1
    as the one product over the joined weights (`Block.dense_decode_in` at one row, no fc1 of its
    own), by default, whose QKV epilogue kernel (interpreted) then reads its columns in place (the
    wide read, on at one row; MD3's dense layers with tau over those columns). The same tokens,
    outputs and KV within bf16 rounding of the one-row step without it (=0), which never calls it."""
    from kestrel_jax.models.text import Block
    from kestrel_jax.pallas import qkv_epilogue as qe

    rows_in: list[int] = []
    original = Block.dense_decode_in

    def counted(self: Block, n: jax.Array) -> Any:
        rows_in.append(n.shape[0])
        return original(self, n)

    monkeypatch.setattr(Block, "dense_decode_in", counted)
    monkeypatch.setenv("KESTREL_JAX_DENSE_IN_ONE_ROW", "0")
    ref, _ = _steps(family, "on", 1)
    assert 1 not in rows_in
    widths: list[int] = []
    kernel = qe.decode_qkv_kernel

    def interpreted(u: jax.Array, *args: Any, **kwargs: Any) -> Any:
        widths.append(u.shape[1])
        return kernel(u, *args, interpret=True, **kwargs)

    monkeypatch.delenv("KESTREL_JAX_DENSE_IN_ONE_ROW")
    assert ops.dense_in_one_row()  # the default
    _route_through(monkeypatch, "decode_qkv", qe, "decode_qkv_kernel", interpreted)
    got, _ = _steps(family, "on", 1)
    # (every layer asks, once per trace; MD3's MoE layer gets None)
    assert rows_in.count(1) and rows_in.count(1) % LAYERS[family] == 0
    # the epilogue reads the joined product in place (MD3's with tau over its QKV columns); the MoE
    # layers' QKV products (MD3) are their own
    assert widths and (3 * 256 + 512) in widths
    assert set(widths) <= {3 * 256 + 512, 3 * 256}
    _assert_same_tokens(got, ref)


@pytest.mark.parametrize("family,bucket", [("md2", 2), ("md3", 2), ("md2", 64)])
def test_joined_products_through_the_decode_gemm_kernel(family: Literal["md2", "md3"], bucket: int,
                                                        monkeypatch: pytest.MonkeyPatch):
    """KESTREL_JAX_GEMV_DENSE_IN / _OUT / _STAGES: the dense layers' joined decode products through
    `ops.small_linear`'s decode GEMM kernel (interpreted here, the other ops on jnp) with the K
    splits and ring stages asked for (row-major partials in a 64-row step): the QKV + fc1 product
    at any step size, the output + fc2 product in 64-row steps only (XLA's below). The same
    sampled tokens, the outputs and KV within bf16 rounding of XLA's products (the kernel's f32
    sums run in another order). A split count that does not divide the product's K steps is
    refused at trace time."""
    ref, _, _ = _joined_steps(family, bucket, _switches())  # XLA's joined products
    calls = _gemv_through_kernel(monkeypatch)
    monkeypatch.setenv("KESTREL_JAX_GEMV_DENSE_IN", "2")  # K = 256: 4 steps of 64
    monkeypatch.setenv("KESTREL_JAX_GEMV_DENSE_OUT", "3")  # K = 256 + 512: 12 steps
    monkeypatch.setenv("KESTREL_JAX_GEMV_DENSE_STAGES", "2")
    got, _ = _steps(family, "on", bucket)
    # both joined products, in the decode steps (the jitted kernel is traced once per shape)
    wide = bucket == 64
    assert set(calls) == {(bucket, 256, 2, 2, wide)} | ({(bucket, 768, 3, 2, True)} if wide else set())
    _assert_same_tokens(got, ref)
    monkeypatch.setenv("KESTREL_JAX_GEMV_DENSE_IN", "3")  # does not divide 4 steps
    _decode_refuses(family, bucket, "splits must divide the 4 K steps")
    if wide:
        monkeypatch.setenv("KESTREL_JAX_GEMV_DENSE_IN", "2")
        monkeypatch.setenv("KESTREL_JAX_GEMV_DENSE_OUT", "5")  # does not divide 12 steps
        _decode_refuses(family, bucket, "splits must divide the 12 K steps")
    monkeypatch.setenv("KESTREL_JAX_GEMV_DENSE_STAGES", "0")
    with pytest.raises(ValueError, match="KESTREL_JAX_GEMV_DENSE_STAGES must be an integer"):
        ops.dense_decode_gemv()


def test_output_product_through_the_kernel_by_default(monkeypatch: pytest.MonkeyPatch):
    """Unset switches: a 64-row decode step forms each dense layer's joined output + fc2 product
    with the decode GEMM kernel (4 splits, 8 ring stages, row-major partials) and the QKV + fc1
    product with XLA's GEMM; the tokens match XLA's. The default gives way to XLA's GEMM where 4 does
    not divide the product's K steps; a value set in the environment stays as asked."""
    for name in ("KESTREL_JAX_GEMV_DENSE_IN", "KESTREL_JAX_GEMV_DENSE_OUT", "KESTREL_JAX_GEMV_DENSE_STAGES"):
        monkeypatch.delenv(name, raising=False)
    ref, _, _ = _joined_steps("md2", 64, _switches())
    calls = _gemv_through_kernel(monkeypatch)
    got, _ = _steps("md2", "on", 64)
    assert set(calls) == {(64, 768, 4, 8, True)}
    _assert_same_tokens(got, ref)
    assert ops.dense_out_splits(768) == 4 and ops.dense_out_splits(64 * 6) == 0 and ops.dense_out_splits(100) == 0
    monkeypatch.setenv("KESTREL_JAX_GEMV_DENSE_OUT", "4")
    assert ops.dense_out_splits(64 * 6) == 4  # asked for: the kernel refuses it when traced
    monkeypatch.setenv("KESTREL_JAX_GEMV_DENSE_OUT", "0")
    assert ops.dense_out_splits(768) == 0


@pytest.mark.parametrize("family", ["md2", "md3"])
def test_one_row_output_product_over_the_joined_weights(family: Literal["md2", "md3"],
                                                        monkeypatch: pytest.MonkeyPatch):
    """A one-row decode step forms each dense layer's output projection + fc2 as the one product
    over the joined weights (fc1 on its own), by default through the decode GEMM kernel (interpreted
    here) in 4 K ranges, with KESTREL_JAX_GEMV_DENSE_OUT_ONE_ROW=0 through XLA's GEMM: the same
    tokens, outputs and KV within bf16 rounding of the separate products
    (KESTREL_JAX_DENSE_OUT_ONE_ROW=0)."""
    for name in ("KESTREL_JAX_DENSE_OUT_ONE_ROW", "KESTREL_JAX_GEMV_DENSE_OUT_ONE_ROW"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KESTREL_JAX_DENSE_OUT_ONE_ROW", "0")
    seen = _count_joined_output_products(monkeypatch)
    ref, _ = _steps(family, "on", 1)
    assert seen == []  # switched off: the separate products
    monkeypatch.delenv("KESTREL_JAX_DENSE_OUT_ONE_ROW")
    monkeypatch.setenv("KESTREL_JAX_GEMV_DENSE_OUT_ONE_ROW", "0")
    got, _ = _steps(family, "on", 1)
    assert seen and set(seen) == {1} and len(seen) % _dense_layers(family) == 0
    _assert_same_tokens(got, ref)

    calls = _gemv_through_kernel(monkeypatch)
    monkeypatch.delenv("KESTREL_JAX_GEMV_DENSE_OUT_ONE_ROW")  # the default: 4 K ranges of the 12 steps
    got, _ = _steps(family, "on", 1)
    assert set(calls) == {(1, 768, 4, 8, False)}
    _assert_same_tokens(got, ref)
    assert ops.dense_out_splits(64 * 6, one_row=True) == 0  # 4 does not divide 6 steps: XLA's GEMM


@pytest.mark.parametrize("family", ["md2", "md3"])
def test_one_row_dense_layer_norm_in_one_launch(family: Literal["md2", "md3"], monkeypatch: pytest.MonkeyPatch):
    """A one-row decode step forms each dense layer's LayerNorm, and the LM head's `post_ln`, with
    the rows kernel (interpreted here), unpadded: the same tokens, outputs and KV within rounding of
    XLA's statistics and normalisation (the kernel sums in another order). On by default;
    KESTREL_JAX_DENSE_LN_ONE_ROW=0 keeps XLA's; steps of more rows keep XLA's."""
    from kestrel_jax.pallas import layer_norm_triton as L

    monkeypatch.setenv("KESTREL_JAX_DENSE_LN_ONE_ROW", "0")
    ref, _ = _steps(family, "on", 1)
    shapes: list[tuple[int, ...]] = []
    kernel = L.layer_norm_rows_kernel

    def interpreted(x: jax.Array, *args: Any, **kwargs: Any) -> Any:
        shapes.append(x.shape)
        return kernel(x, *args, interpret=True, **kwargs)

    row, scale = jnp.ones((1, 256), jnp.bfloat16), jnp.ones((256,), jnp.bfloat16)
    with ops.use_backend("kernel"):  # off: XLA's LayerNorm even on the kernel path
        assert ops.decode_dense_layer_norm(row, scale, scale, eps=1e-5) is None
    monkeypatch.delenv("KESTREL_JAX_DENSE_LN_ONE_ROW")
    _route_through(monkeypatch, "decode_dense_layer_norm", L, "layer_norm_rows_kernel", interpreted)
    from kestrel_jax.serving import runner as runner_mod

    sampled: list[jnp.dtype] = []  # the steps hand the sampler the LM head's bf16 logits, no f32 copy
    real_sample = runner_mod.sample

    def recorded(logits: jax.Array, *args: Any, **kwargs: Any) -> Any:
        sampled.append(logits.dtype)
        return real_sample(logits, *args, **kwargs)

    monkeypatch.setattr(runner_mod, "sample", recorded)
    got, _ = _steps(family, "on", 1)
    assert sampled and set(sampled) == {jnp.dtype(jnp.bfloat16)}
    # per one-row step: the dense layers' and post_ln's
    assert shapes and set(shapes) == {(1, 256)} and len(shapes) % (_dense_layers(family) + 1) == 0
    _assert_same_tokens(got, ref)
    shapes.clear()
    _steps(family, "on", 2)
    assert shapes == []


def test_projection_gemm_tuning_switches_reach_the_kernel(monkeypatch: pytest.MonkeyPatch):
    """KESTREL_JAX_GEMV_PROJ_SPLITS / _STAGES: an MoE layer's decode output projection runs the
    decode GEMM kernel (interpreted here) with the K splits and ring stages asked for; the tokens and
    outputs are those of the jnp path within rounding. Unset: the kernel's own choice (no splits
    passed, 4 stages)."""
    for name in ("KESTREL_JAX_GEMV_PROJ_SPLITS", "KESTREL_JAX_GEMV_PROJ_STAGES"):
        monkeypatch.delenv(name, raising=False)
    assert ops.proj_gemv_tuning() == (None, 4)
    ref, _, _ = _joined_steps("md3", 1, _switches())
    calls = _gemv_through_kernel(monkeypatch)
    monkeypatch.setenv("KESTREL_JAX_GEMV_PROJ_SPLITS", "2")  # K = 256: 4 steps of 64
    monkeypatch.setenv("KESTREL_JAX_GEMV_PROJ_STAGES", "3")
    got, _ = _steps("md3", "on", 1)
    assert (1, 256, 2, 3, False) in calls  # the MoE layer's projection (dense ones: the joined product)
    _assert_same_tokens(got, ref)
    monkeypatch.setenv("KESTREL_JAX_GEMV_PROJ_STAGES", "0")
    with pytest.raises(ValueError, match="KESTREL_JAX_GEMV_PROJ_STAGES must be an integer"):
        ops.proj_gemv_tuning()


def test_runners_started_at_once_on_one_model_all_get_them():
    """An engine starts one runner per device at once, all on one model: each joins, splits and
    unjoins it in turn (a lock), so every runner's params hold the joined weights."""
    from concurrent.futures import ThreadPoolExecutor

    model = random_model(_config("md2"), dtype=jnp.bfloat16, seed=3)
    cfg = RunnerConfig(num_pages=16, kv_dtype="bf16", max_seq_len=128, page_size=PAGE, vision_buckets=(2,),
                       fused_dense_decode="on")
    with ThreadPoolExecutor(4) as pool:
        runners = list(pool.map(lambda _: Runner(model, cfg, out_rows=8), range(4)))
    assert len({len(r.lm_params) for r in runners}) == 1 and all(r.joined_dense_bytes for r in runners)
    assert all(b.dense_w is None for b in model.text.blocks)


def test_bad_setting_is_refused():
    model = random_model(_config("md2"), dtype=jnp.bfloat16, seed=3)
    with pytest.raises(ValueError, match="fused_dense_decode must be auto, on or off"):
        Runner(model, RunnerConfig(num_pages=16, max_seq_len=128, page_size=PAGE, vision_buckets=(2,),
                                   fused_dense_decode="yes"), out_rows=8)
