"""Region model: Fourier coordinate/size encoders and their decoders (MOONDREAM.md §7).

Decoders read the text decoder's hidden state *before* `post_ln`. MD2 decoders are GELU-tanh
MLPs; MD3 decoders are single Linears, preceded by the region LayerNorm only when the
checkpoint has one.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from kestrel_jax.models.config import RegionConfig
from kestrel_jax.models.layers import MLP, LayerNorm, Linear, gelu_tanh
from kestrel_jax.pallas import ops


def coord_bin_to_value(bins: jax.Array) -> jax.Array:
    """Coordinate bin -> value in [0, 1): bin / 1024 (float32)."""
    return bins.astype(jnp.float32) / 1024.0


def size_bin_to_value(bins: jax.Array) -> jax.Array:
    """Size bin -> 2^(10 * bin/1023 - 10) in [2^-10, 1] (log scale, float32)."""
    return jnp.exp2(bins.astype(jnp.float32) / 1023.0 * 10.0 - 10.0)


def size_value_to_bin(s: jax.Array) -> jax.Array:
    """Inverse of `size_bin_to_value` (for encoding targets): nearest bin."""
    b = (jnp.log2(jnp.maximum(s, 1.0 / 1024.0)) + 10.0) / 10.0 * 1023.0
    return jnp.clip(jnp.round(b), 0, 1023).astype(jnp.int32)


class RegionModel(nnx.Module):
    def __init__(self, cfg: RegionConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        normal = nnx.initializers.normal(1.0)
        self.coord_features = nnx.Param(normal(rngs.params(), (1, cfg.coord_feat_dim // 2), dtype))
        self.coord_encoder = Linear(cfg.coord_feat_dim, cfg.dim, dtype=dtype, rngs=rngs)
        self.size_features = nnx.Param(normal(rngs.params(), (2, cfg.size_feat_dim // 2), dtype))
        self.size_encoder = Linear(cfg.size_feat_dim, cfg.dim, dtype=dtype, rngs=rngs)
        self.coord_decoder: MLP | Linear
        self.size_decoder: MLP | Linear
        if cfg.inner_dim is not None:
            self.coord_decoder = MLP(cfg.dim, cfg.inner_dim, cfg.coord_out_dim, dtype=dtype, rngs=rngs)
            self.size_decoder = MLP(cfg.dim, cfg.inner_dim, cfg.size_out_dim, dtype=dtype, rngs=rngs)
        else:
            self.coord_decoder = Linear(cfg.dim, cfg.coord_out_dim, dtype=dtype, rngs=rngs)
            self.size_decoder = Linear(cfg.dim, cfg.size_out_dim, dtype=dtype, rngs=rngs)
        self.ln = LayerNorm(cfg.dim, dtype=dtype) if cfg.has_ln else None

    @staticmethod
    def _fourier(x: jax.Array, freqs: jax.Array) -> jax.Array:
        """x [N, k] @ freqs [k, F] -> [N, 2F] = [cos(2 pi x F) | sin(2 pi x F)], float32."""
        f = (2.0 * math.pi) * jnp.dot(x.astype(jnp.float32), freqs.astype(jnp.float32),
                                      precision=jax.lax.Precision.HIGHEST)
        return jnp.concatenate([jnp.cos(f), jnp.sin(f)], axis=-1)

    @staticmethod
    def _linear(layer: Linear, x: jax.Array, kernel_rows: int, gate: ops.Gate | None = None) -> jax.Array:
        """`layer(x)`, through the decode GEMM kernel when x has at most `kernel_rows` rows and the
        kernel path is on (`ops.small_linear`): at one row XLA rewrites these small products into
        a multiply + reduce that writes the whole [K, N] product (MD3's 2,048-square size decoder:
        12.9 us per decode step on an H100). `gate` (`ops.region_gate_wanted`): where its element is
        0 the kernel skips the product (the result is the bias: no row of the step reads it)."""
        if kernel_rows:
            bias = layer.bias[...] if layer.bias is not None else None
            y = ops.small_linear(x, layer.kernel[...], bias, max_rows=kernel_rows, gate=gate)
            if y is not None:
                return y
        return layer(x)

    def _mlp(self, mlp: MLP, x: jax.Array, kernel_rows: int, gate: ops.Gate) -> jax.Array:
        """An MD2 decoder MLP, both products on the decode GEMM kernel, gated."""
        return self._linear(mlp.fc2, gelu_tanh(self._linear(mlp.fc1, x, kernel_rows, gate)), kernel_rows, gate)

    def encode_coordinate(self, v: jax.Array, dtype: jnp.dtype, kernel_rows: int = 0,
                          gate: ops.Gate | None = None) -> jax.Array:  # [N, 1] -> [N, D]
        return self._linear(self.coord_encoder, self._fourier(v, self.coord_features[...]).astype(dtype), kernel_rows,
                            gate)

    def encode_size(self, s: jax.Array, dtype: jnp.dtype, kernel_rows: int = 0,
                    gate: ops.Gate | None = None) -> jax.Array:  # [N, 2] -> [N, D]
        return self._linear(self.size_encoder, self._fourier(s, self.size_features[...]).astype(dtype), kernel_rows,
                            gate)

    def _in(self, h: jax.Array) -> jax.Array:
        return self.ln(h) if self.ln is not None else h

    def decode_coordinate(self, h: jax.Array) -> jax.Array:  # [N, D] -> [N, coord_bins] f32
        return self.coord_decoder(self._in(h)).astype(jnp.float32)

    def decode_size(self, h: jax.Array) -> jax.Array:  # [N, D] -> [N, 2, size_bins] f32 (w, h)
        out = self.size_decoder(self._in(h)).astype(jnp.float32)
        return out.reshape(h.shape[0], 2, -1)

    def decode_heads(self, h: jax.Array, kernel_rows: int = 0,
                     gate: ops.Gate | None = None) -> tuple[jax.Array, jax.Array]:
        """(`decode_coordinate(h)`, `decode_size(h)`). With single-Linear decoders (MD3) and at
        most `kernel_rows` rows on the kernel path, both products come from one decode GEMM launch
        (`ops.small_linear_pair`); MD2's MLPs take it only with a `gate` (`_linear`'s: where its
        element is 0 the outputs are those of zero products, which no row of the step reads)."""
        if kernel_rows and isinstance(self.coord_decoder, Linear) and isinstance(self.size_decoder, Linear):
            c, sz = self.coord_decoder, self.size_decoder
            pair = ops.small_linear_pair(
                self._in(h), c.kernel[...], c.bias[...] if c.bias is not None else None,
                sz.kernel[...], sz.bias[...] if sz.bias is not None else None, max_rows=kernel_rows, gate=gate)
            if pair is not None:
                coord, size, _ = pair
                return _materialised(coord.astype(jnp.float32), size.astype(jnp.float32).reshape(h.shape[0], 2, -1))
        if kernel_rows and gate is not None and isinstance(self.coord_decoder, MLP) and isinstance(
                self.size_decoder, MLP):
            x = self._in(h)
            coord = self._mlp(self.coord_decoder, x, kernel_rows, gate).astype(jnp.float32)
            size = self._mlp(self.size_decoder, x, kernel_rows, gate).astype(jnp.float32)
            return _materialised(coord, size.reshape(h.shape[0], 2, -1))
        return self.decode_coordinate(h), self.decode_size(h)


def _materialised(coord: jax.Array, size: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The decode GEMM's head logits behind an optimization barrier where
    `ops.heads_barrier_wanted()`: XLA otherwise fuses the sum of the kernel's split partials (and
    the bias) into the bins' argmax, a reduction of one row that runs as one CTA reading every
    partial (H100, MD3 batch-1 step, twenty-second session: the two argmax fusions 6.2 and 9.9 us).
    Behind the barrier the sum is a loop fusion of its own and the argmaxes read [rows, bins]."""
    if ops.heads_barrier_wanted():
        return jax.lax.optimization_barrier((coord, size))
    return coord, size
