"""Small building blocks shared by the vision, text and region modules."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def gelu_tanh(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=True)


def gelu_erf(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=False)


class Linear(nnx.Module):
    """`y = x @ kernel + bias` with kernel stored `[in, out]` (the checkpoint's weight transposed)."""

    def __init__(self, din: int, dout: int, *, bias: bool = True, dtype: jnp.dtype, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.kernel = nnx.Param(init(rngs.params(), (din, dout), dtype))
        self.bias = nnx.Param(jnp.zeros((dout,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        k = self.kernel[...]
        y = jnp.dot(x, k.astype(x.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(x.dtype)
        return y


class LayerNorm(nnx.Module):
    """LayerNorm with weight and bias; statistics in float32 (eps 1e-5 everywhere in Moondream)."""

    def __init__(self, dim: int, *, eps: float = 1e-5, dtype: jnp.dtype):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return layer_norm(x, self.scale[...], self.bias[...], self.eps)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis in float32, output in x.dtype. One pass (E[x], E[x^2]): XLA
    computes both sums in one reduction kernel instead of two dependent ones; in float32 over the
    model widths the cancellation error is far below the bf16 rounding of the output."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.maximum(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) - jnp.square(mean), 0.0)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    y = y * scale.astype(jnp.float32) + bias.astype(jnp.float32)
    return y.astype(x.dtype)


class MLP(nnx.Module):
    """fc2(GELU_tanh(fc1(x)))."""

    def __init__(self, din: int, hidden: int, dout: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.fc1 = Linear(din, hidden, dtype=dtype, rngs=rngs)
        self.fc2 = Linear(hidden, dout, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        # fc1 and the GELU through `ops.linear_gelu`: one fused kernel on a GPU at prefill sizes,
        # `gelu_tanh(self.fc1(x))`'s expressions everywhere else (imported here: ops imports this module)
        from kestrel_jax.pallas import ops

        return self.fc2(ops.linear_gelu(x, self.fc1))


# --------------------------------------------------------------------------------------------
# Rotary embedding: first `rotary_dim` channels of each head, half-split pairs (j, j + rot/2).


def rope_inv_freq(rotary_dim: int, theta: float) -> np.ndarray:
    """inv_freq_j = 1 / theta^(2j / rotary_dim), j < rotary_dim/2, computed as float32 powers."""
    j = np.arange(0, rotary_dim, 2, dtype=np.float32)
    return (1.0 / np.power(np.float32(theta), j / np.float32(rotary_dim))).astype(np.float32)


def rope_cos_sin(positions: jax.Array, rotary_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """positions [T] int -> cos, sin [T, rotary_dim/2] float32 (angle = f32(pos) * inv_freq)."""
    inv = jnp.asarray(rope_inv_freq(rotary_dim, theta))
    ang = positions.astype(jnp.float32)[:, None] * inv[None, :]
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, rotary_dim: int) -> jax.Array:
    """x [T, H, Dh]; rotates channels [0, rotary_dim) in float32, output half-split layout.

    The reference writes the rotated pairs back interleaved; since Q and K get the same layout,
    every Q.K product is unchanged (see MOONDREAM.md §3.3). `interleave_rotary` converts a K
    cache to the reference layout for comparisons.
    """
    half = rotary_dim // 2
    xf = x.astype(jnp.float32)
    r, i, rest = xf[..., :half], xf[..., half:rotary_dim], x[..., rotary_dim:]
    c, s = cos[:, None, :], sin[:, None, :]
    r2 = r * c - i * s
    i2 = r * s + i * c
    rot = jnp.concatenate([r2, i2], axis=-1).astype(x.dtype)
    return jnp.concatenate([rot, rest], axis=-1)


def interleave_rotary(x: np.ndarray, rotary_dim: int) -> np.ndarray:
    """[..., Dh] half-split rotary layout -> the reference's interleaved (r0, i0, r1, i1, ...)."""
    half = rotary_dim // 2
    out = np.array(x, copy=True)
    rot = np.stack([x[..., :half], x[..., half:rotary_dim]], axis=-1)
    out[..., :rotary_dim] = rot.reshape(*x.shape[:-1], rotary_dim)
    return out


def tau_position_term(positions: jax.Array, alpha: jax.Array) -> jax.Array:
    """[T] positions, [H] alpha -> [T, H] float32: 0.5 + sigmoid(alpha * ln(pos + 1)).

    Computed in float32 from exact integer positions (the reference's bf16 cast of positions
    rounds above 256; MOONDREAM.md §10.3 recommends the exact form).
    """
    lp = jnp.log(positions.astype(jnp.float32) + 1.0)
    return 0.5 + jax.nn.sigmoid(alpha.astype(jnp.float32)[None, :] * lp[:, None])


def two_pi() -> float:
    return 2.0 * math.pi
