"""fc1 with its GELU fused (`dense_mgpu.linear_gelu`): interpreted on the CPU against the unfused
path's arithmetic (`linear_gelu_ref`: the bf16 product + bias rounded once, GELU_tanh in f32,
rounded) on fresh random inputs, for row counts that are and are not multiples of the 256-row
tile (64-row tail tiles, or the last tile shifted up), both column tiles, 2-4 ring stages and few CTAs (each loops over
several tiles, the ring running on across them), with race detection; the interpreter fills the
output with NaN first, so an element left unwritten fails; its shape checks; the dispatch in
`ops.linear_gelu` (and so `MLP.__call__`); and its lowering at MD2's prefill / mixed shapes.

Bound: the kernel sums the products in its own order, so its rounded product h may differ from the
reference's by one bf16 step of h (2^-7 |h| at most), which moves GELU by at most 1.13 times that
(|GELU'| <= 1.13), plus one rounding step of the output: elementwise |y - ref| <= 2^-7 (1.13 |h| +
|ref|), plus the f32 sums' order difference where h cancels to near 0; almost all outputs equal.
(In ulps of the output the bound is loose where GELU is tiny: GELU(-4) ~ -1e-4 moves by many of
its own ulps when h moves by one of h's.)"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractDevice, AbstractMesh, AxisType
from kernel_helpers import as_f32, fresh_rng

from kestrel_jax.models.layers import MLP, Linear, gelu_tanh
from kestrel_jax.pallas import dense_mgpu as D
from kestrel_jax.pallas import ops
from kestrel_jax.pallas.paged_attention_mgpu import interpret_races_found

BF16 = jnp.bfloat16
_SDS = jax.ShapeDtypeStruct


def _check(y: jax.Array, x: jax.Array, w: jax.Array, b: jax.Array | None, ref: jax.Array) -> None:
    h = np.asarray(jnp.dot(x, w, preferred_element_type=jnp.float32))
    if b is not None:
        h = h + as_f32(b)
    r = as_f32(ref)
    err = np.abs(as_f32(y) - r)
    # + the f32 sums' own order difference (2^-20 of the sum of |terms|: K <= 192 here)
    slack = 2.0 ** -20 * np.abs(as_f32(x)) @ np.abs(as_f32(w))
    assert np.all(err <= 2.0 ** -7 * (1.13 * (np.abs(h) + slack) + np.abs(r)) + slack), float(err.max())
    assert (err == 0).mean() > 0.98, (err == 0).mean()


def _operands(rng: np.random.Generator, M: int, K: int, N: int, bias: bool = True):
    x = jnp.asarray(rng.standard_normal((M, K)), BF16)
    w = jnp.asarray(rng.standard_normal((K, N)) * K ** -0.5 * 2.0, BF16)
    b = jnp.asarray(rng.standard_normal(N) * 0.5, BF16) if bias else None
    return x, w, b


@pytest.mark.parametrize("M,K,N,block_n,stages,ctas", [
    (256, 128, 128, 128, 2, 1),  # one tile
    (512, 192, 256, 128, 3, 3),  # 4 tiles on 3 CTAs: a CTA runs two, its ring across both
    (512, 128, 256, 64, 4, 2),  # 8 tiles of 64 columns, 2 K steps in a 4-deep ring
    (320, 192, 256, 128, 4, 3),  # 2 full tiles + 2 tail tiles of 64 rows; stores 64 columns at a time
    (576, 64, 384, 128, 3, 4),  # 6 full + 3 tail tiles, ragged over 4 CTAs
    (320, 64, 384, 128, 3, 1),  # one CTA: 3 full tiles, then 3 tail tiles in a row (one store buffer)
])
def test_interpreted_matches_the_unfused_arithmetic_without_races(M, K, N, block_n, stages, ctas):
    x, w, b = _operands(fresh_rng(), M, K, N)
    y = D.linear_gelu(x, w, b, block_n=block_n, stages=stages, num_ctas=ctas, interpret=True, detect_races=True)
    assert not interpret_races_found()
    ref = D.linear_gelu_ref(x, w, b)
    _check(y, x, w, b, ref)
    # The unfused jnp expressions on bf16 round after every step of the GELU (jax.nn.gelu computes
    # in the input's dtype), so they sit further from the f32-GELU reference (the reference
    # implementation's arithmetic: PyTorch computes a bf16 GELU in f32) than the kernel does.
    # (Compared by the mean error: both maxima are often one bf16 step of the largest outputs.)
    unfused = gelu_tanh(jnp.dot(x, w) + b)
    ours, theirs = np.abs(as_f32(y) - as_f32(ref)), np.abs(as_f32(unfused) - as_f32(ref))
    assert ours.max() <= theirs.max() and ours.mean() < theirs.mean(), (ours.mean(), theirs.mean())


@pytest.mark.parametrize("M,block_n,stages", [(296, 128, 3), (264, 128, 4), (704, 128, 3), (296, 64, 4)])
def test_ragged_rows_and_no_bias(M, block_n, stages):
    """M not a multiple of 256: up to 64 rows past the last full tile are tail tiles ending at row
    M (BN = 128); more, or BN = 64, shift the last full tile up to end there. Either way some rows
    are computed twice, by two CTAs, with the same values: a benign overlap, so no race detection."""
    x, w, _ = _operands(fresh_rng(), M, 64, 256, bias=False)
    y = D.linear_gelu(x, w, None, block_n=block_n, stages=stages, num_ctas=2, interpret=True)
    assert y.shape == (M, 256)
    _check(y, x, w, None, D.linear_gelu_ref(x, w, None))


def test_shape_checks():
    x, w, b = _operands(fresh_rng(), 256, 128, 256)
    assert D.problem(x, w, b) is None
    assert "M=255" in (D.problem(x[:255], w, b) or "")
    assert "M=300 is not a multiple of 8" in (D.problem(jnp.zeros((300, 128), BF16), w, b) or "")
    assert "multiple of 128" in (D.problem(x, w[:, :192], b[:192]) or "")
    assert "K=96 of 64" in (D.problem(x[:, :96], w[:96], b) or "")
    assert "bf16" in (D.problem(x.astype(jnp.float32), w, b) or "")
    assert "bias" in (D.problem(x, w, b[:128]) or "")
    assert "SMEM" in (D.problem(x, w, b, stages=9) or "")
    with pytest.raises(ValueError, match="linear_gelu: .*M=100"):
        D.linear_gelu(x[:100], w, b, interpret=True)


def _linear(w: jax.Array, b: jax.Array) -> Linear:
    layer = Linear(w.shape[0], w.shape[1], dtype=BF16, rngs=nnx.Rngs(3))
    layer.kernel[...] = w
    assert layer.bias is not None
    layer.bias[...] = b
    return layer


def test_ops_dispatch(monkeypatch: pytest.MonkeyPatch):
    rng = fresh_rng()
    x, w, b = _operands(rng, 304, 128, 256)
    fc1, narrow = _linear(w, b), _linear(w[:, :192], b[:192])
    unfused = gelu_tanh(jnp.dot(x, w) + b)
    # on the CPU: the model's expressions themselves, bit for bit
    np.testing.assert_array_equal(as_f32(ops.linear_gelu(x, fc1)), as_f32(unfused))
    seen: list[dict[str, Any]] = []

    def spy(x2, w2, b2, **kw):
        seen.append({"shape": x2.shape, **kw})
        return D.linear_gelu(x2, w2, b2, num_ctas=2, interpret=True, **kw)

    monkeypatch.setattr(ops, "_jitted", lambda fn, static=(): spy)
    with ops.use_backend("kernel"):
        got = ops.linear_gelu(x.reshape(2, 152, 128), fc1)  # leading axes folded into rows and back
        assert got.shape == (2, 152, 256)
        assert seen.pop() == {"shape": (304, 128), "block_n": D.DEFAULT_BLOCK_N, "stages": D.DEFAULT_STAGES}
        _check(got.reshape(304, 256), x, w, b, D.linear_gelu_ref(x, w, b))
        ops.linear_gelu(x[:255], fc1)  # fewer rows than one tile: XLA
        ops.linear_gelu(x, narrow)  # a width the kernel does not take: XLA
        monkeypatch.setenv("KESTREL_JAX_LINEAR_GELU", "0")  # the A/B switch
        ops.linear_gelu(x, fc1)
        assert seen == []
        monkeypatch.setenv("KESTREL_JAX_LINEAR_GELU", "1")
        monkeypatch.setenv("KESTREL_JAX_LINEAR_GELU_BN", "64")
        monkeypatch.setenv("KESTREL_JAX_LINEAR_GELU_STAGES", "4")
        ops.linear_gelu(x, fc1)
        assert seen.pop() == {"shape": (304, 128), "block_n": 64, "stages": 4}
        monkeypatch.setenv("KESTREL_JAX_LINEAR_GELU_BN", "96")  # refused: named, not a silent XLA run
        with pytest.raises(ValueError, match="KESTREL_JAX_LINEAR_GELU_BN=96"):
            ops.linear_gelu(x, fc1)
        # MLP.__call__ goes through it
        monkeypatch.delenv("KESTREL_JAX_LINEAR_GELU_BN")
        monkeypatch.delenv("KESTREL_JAX_LINEAR_GELU_STAGES")
        mlp = MLP(128, 256, 64, dtype=BF16, rngs=nnx.Rngs(3))
        mlp.fc1 = fc1
        out = mlp(x)
        assert seen.pop()["shape"] == (304, 128)
    np.testing.assert_array_equal(as_f32(mlp(x)), as_f32(mlp.fc2(unfused)))  # CPU: unchanged
    ref_out = as_f32(mlp.fc2(D.linear_gelu_ref(x, w, b)))
    assert np.abs(as_f32(out) - ref_out).max() <= 0.01 * np.abs(ref_out).max()


def test_lowers_at_md2_prefill_and_mixed_shapes():
    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    for M, bn, stages in [(1600, 128, 3), (1600, 128, 4), (768, 64, 4), (2048, 128, 3), (704, 128, 3)]:
        def f(x, w, b, bn=bn, stages=stages):
            return D.linear_gelu(x, w, b, block_n=bn, stages=stages, num_ctas=132)
        with jax.sharding.use_abstract_mesh(mesh):
            text = jax.jit(f).trace(_SDS((M, 2048), BF16), _SDS((2048, 8192), BF16),
                                    _SDS((8192,), BF16)).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text
