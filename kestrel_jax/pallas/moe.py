"""Mixture-of-experts FFN (Moondream 3 layers >= moe.start_layer): pure-jnp reference.

The Pallas kernels (`moe_mgpu.py`) implement the same signatures and are tested against these.

Expert weight layout (PyTorch/HF `[out, in]` per expert, i.e. K-major for both matmuls):
    up_w:   [E, 2I, D]   rows 0..I-1 -> GELU_erf branch h, rows I..2I-1 -> (+1) gate branch g
    down_w: [E, D, I]
Either bfloat16/float32, or float8_e4m3fn with per-(expert, output row) float32 scales
    up_scale: [E, 2I], down_scale: [E, D]  so that W[e, n, :] ~= fp8[e, n, :] * scale[e, n].

`moe_layer_ref` (routing + `moe_ref`) is the model's CPU path and the kernels' oracle.
`moe_ref(..., quantize_activations=True)` reproduces the W8A8 kernels' numerics: tokens and
the up projection's output quantised per row to e4m3 (`quantize_rows`) before each GEMM, the
GEMMs in float32.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

FP8_MAX = 448.0


class ExpertWeights(NamedTuple):
    up_w: jax.Array  # [E, 2I, D]
    down_w: jax.Array  # [E, D, I]
    up_scale: jax.Array | None = None  # [E, 2I] f32 (FP8 only)
    down_scale: jax.Array | None = None  # [E, D] f32 (FP8 only)

    @property
    def is_fp8(self) -> bool:
        return self.up_scale is not None


class Routing(NamedTuple):
    weights: jax.Array  # [T, k] f32, softmax over the selected logits
    experts: jax.Array  # [T, k] int32, descending logit, ties -> lower expert id
    logits: jax.Array  # [T, E] f32 router logits


def gelu_erf_poly(h: jax.Array) -> jax.Array:
    """Exact-erf GELU with erf from Abramowitz-Stegun 7.1.26 (|error| <= 1.5e-7).

    Written without a select: gelu(h) = (h + |h| * erf(|h| / sqrt 2)) / 2 and
    erf(a) = 1 - poly(t) exp(-a^2), t = 1 / (1 + p a). Only exp and a division are needed: every
    Mosaic GPU layout supports both, and Pallas Triton has no erf. The kernels use it (the MoE up
    projection's epilogue, the tau of the decode QKV epilogue); the jnp references use jax.nn.gelu.
    """
    a = jnp.abs(h)
    t = 1.0 / (1.0 + (0.3275911 * 0.7071067811865476) * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    q = poly * jnp.exp(-0.5 * h * h)
    return 0.5 * (h + a * (1.0 - q))


def router_logits(x: jax.Array, router_w: jax.Array, router_b: jax.Array, *, widen: bool = True) -> jax.Array:
    """x [T, D], router_w [D, E], router_b [E] -> [T, E]: the GEMM and the bias add in x.dtype (a
    bf16 model rounds the product and the sum to bf16), then widened to float32 unless `widen`
    is off (a consumer that widens on load saves XLA a conversion kernel)."""
    logits = jnp.dot(x, router_w.astype(x.dtype), precision=jax.lax.Precision.HIGHEST) + router_b.astype(x.dtype)
    return logits.astype(jnp.float32) if widen else logits


def route_ref(x: jax.Array, router_w: jax.Array, router_b: jax.Array, top_k: int) -> Routing:
    """x [T, D], router_w [D, E], router_b [E] -> Routing."""
    logits = router_logits(x, router_w, router_b)
    top, idx = jax.lax.top_k(logits, top_k)  # stable: equal values keep the lower index first
    w = jax.nn.softmax(top, axis=-1)
    return Routing(w, idx.astype(jnp.int32), logits)


def quantize_experts(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[E, N, K] float -> (e4m3 [E, N, K], f32 scale [E, N]) with a per-output-row absmax scale."""
    wf = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(wf), axis=-1)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    q = jnp.clip(wf / scale[..., None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return q, scale


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[R, K] float -> (e4m3 [R, K], f32 scale [R]): per-row (per-token) absmax activation quantisation.

    Same rule as the weights: scale = absmax / 448 (1 for an all-zero row), values clamped to
    +-448 so nothing becomes NaN. Rounding error per element <= 2^-4 relative (3 mantissa bits)
    where v / scale is an e4m3 normal (|v| >= absmax * 2^-6 / 448), else <= 2^-10 * scale.

    The values are multiplied by the reciprocal of the scale rather than divided by it: XLA
    rewrites that division into this product anyway, in some fusions and not others, so that a
    quotient lying exactly on an e4m3 rounding tie rounded one way alone and the other way inside
    a fusion. Written as a product, every compiled path (jitted, `quantize_triton`'s kernel, the
    MoE GEMMs' own quantisation) computes the same; on the CPU, calling it op by op (outside jit)
    can still differ from them in the last bit of a product, and so on an exact tie (x = -3.5625
    with scale 9.5 / 448: -168.00002 op by op, -168.0 compiled), so tests compare compiled calls.
    """
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    inv = 1.0 / scale
    q = jnp.clip(xf * inv[..., None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return q, scale


def dequantize_experts(q: jax.Array, scale: jax.Array, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)


def _expert_matrix(w: jax.Array, scale: jax.Array | None, dtype: jnp.dtype) -> jax.Array:
    if scale is None:
        return w.astype(dtype)
    return dequantize_experts(w, scale, dtype)


def _fake_quantize_rows(x: jax.Array) -> jax.Array:
    q, scale = quantize_rows(x)
    return (q.astype(jnp.float32) * scale[:, None]).astype(x.dtype)


def moe_ref(
    x: jax.Array, routing: Routing, experts: ExpertWeights, *, quantize_activations: bool = False
) -> jax.Array:
    """x [T, D] -> [T, D]: sum_k w_k * down_e(GELU_erf(h) * (g + 1)), (h, g) = up_e(x) halves.

    Reference semantics of the FP8 path: weights dequantised, activations in x.dtype (GEMM
    outputs rounded to x.dtype). With `quantize_activations` it follows the W8A8 kernels instead:
    tokens rounded per row through e4m3, GEMMs in float32 on the dequantised weights, the
    activation computed from the float32 GEMM output, rounded to bf16 (what the up kernel
    stores) and then per row through e4m3, each expert's output rounded to bf16.
    """
    T, D = x.shape
    k = routing.experts.shape[1]
    E, two_i, _ = experts.up_w.shape
    inner = two_i // 2
    f32 = jnp.float32
    cdt = f32 if quantize_activations else x.dtype  # GEMM input and output dtype
    up = _expert_matrix(experts.up_w, experts.up_scale, cdt)  # [E, 2I, D]
    down = _expert_matrix(experts.down_w, experts.down_scale, cdt)  # [E, D, I]

    flat = routing.experts.reshape(-1)  # [T*k]
    order = jnp.argsort(flat, stable=True)
    token = order // k
    xq = _fake_quantize_rows(x.astype(f32)) if quantize_activations else x
    xs = xq[token]  # [T*k, D], grouped by expert
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    hp = jax.lax.Precision.HIGHEST
    z = jax.lax.ragged_dot(xs, up.transpose(0, 2, 1), sizes, precision=hp)  # [T*k, 2I]
    h, g = z[:, :inner], z[:, inner:]
    a = (jax.nn.gelu(h.astype(f32), approximate=False) * (g.astype(f32) + 1.0))
    if quantize_activations:
        a = _fake_quantize_rows(a.astype(jnp.bfloat16).astype(f32))
    else:
        a = a.astype(x.dtype)
    y = jax.lax.ragged_dot(a, down.transpose(0, 2, 1), sizes, precision=hp)  # [T*k, D]
    if quantize_activations:
        y = y.astype(jnp.bfloat16)
    y_tok = jnp.zeros((T * k, D), y.dtype).at[order].set(y).reshape(T, k, D)
    out = jnp.einsum("tk,tkd->td", routing.weights.astype(f32), y_tok.astype(f32), precision=hp)
    return out.astype(x.dtype)


def moe_layer_ref(
    x: jax.Array,  # [T, D]
    router_w: jax.Array,  # [D, E]
    router_b: jax.Array,  # [E]
    experts: ExpertWeights,
    *,
    top_k: int,
    num_valid_tokens: jax.Array | int | None = None,
) -> jax.Array:  # [T, D]
    """Routing + `moe_ref`: the whole MoE FFN. Padding rows (>= num_valid_tokens) give zeros."""
    out = moe_ref(x, route_ref(x, router_w, router_b, top_k), experts)
    if num_valid_tokens is None:
        return out
    keep = jnp.arange(x.shape[0]) < num_valid_tokens
    return jnp.where(keep[:, None], out, jnp.zeros_like(out))
