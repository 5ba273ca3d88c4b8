"""Text decoder: parallel-residual blocks, partial rotary, MD3 tau scaling, dense MLP / MoE.

MOONDREAM.md §3-4. The decoder only knows about pages through `AttentionBatch` (slots, lengths,
page tables) and the per-layer KV pool pair it passes to `kestrel_jax.pallas.ops`; it never sees
requests. A forward pass over T tokens returns the pre-`post_ln` hidden states (what the region
decoders read) and the updated KV cache; `logits()` applies `post_ln` + `lm_head` to chosen rows.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from kestrel_jax.models.config import TextConfig
from kestrel_jax.models.layers import MLP, LayerNorm, Linear, gelu_erf, gelu_tanh
from kestrel_jax.pallas import ops
from kestrel_jax.pallas.decode_residual import ExpertRows, combine_rows
from kestrel_jax.pallas.moe import ExpertWeights
from kestrel_jax.pallas.moe_route_mgpu import DenseRoute
from kestrel_jax.pallas.qkv_epilogue import TauDots, TauWeights, qkv_heads_ref
from kestrel_jax.switches import flag, integer

# Decode rows up to which the attention projections of MoE layers use the decode GEMM kernel
# (`kestrel_jax.pallas.gemv_mgpu`) instead of XLA's GEMM. H100, fifth session, 24 cold weights:
# proj [2048, 2048] 6.0 vs 15.8 us at 1 row, 6.2 vs 10.2 at 8. The QKV product (with the router's,
# `gemv_rows`: finished rows that the QKV epilogue and the routing tables read as they are, the
# LayerNorm kernel ahead of it) at every decode size since the twenty-second session (H100, MD3
# decode step at batch 8 / 32 / 64: CUPTI -4.6 / -3.1 / -1.7%, wall -4.7 / -3.9 / -3.9%; W2 C=64
# 6,653.9 -> 6,744.4 output tok/s), though alone it is slower than XLA's at 8 rows (11.8 vs 10.6
# us, fifth session): what it saves is XLA's split-K sums, converts and concatenations around it.
# KESTREL_JAX_GEMV_QKV_ROWS / KESTREL_JAX_GEMV_PROJ_ROWS (read at trace time, at most the kernel's
# 64) override them for A/B runs.
QKV_KERNEL_ROWS = 64
PROJ_KERNEL_ROWS = 8
# A dense layer's joined decode products through the same kernel (`ops.dense_decode_gemv`): the
# output + fc2 product by default in steps of this many rows and of one row, the QKV + fc1 one opt-in.
DENSE_GEMV_ROWS = 64
# The region heads' small products (encoders [256 | 512, 2048], decoders [2048, 1024 + 2048]), run
# for every row of every step: at one row XLA rewrites each into a multiply + reduce (H100, session
# 21: ~28 us of a batch-1 MD3 decode step for all four). KESTREL_JAX_GEMV_REGION_ROWS overrides.
REGION_KERNEL_ROWS = 8
# Decode rows up to which an MoE layer's output projection rides in its down GEMM's launch
# (`ops.proj_in_down_wanted`): the projection's input padded to the 8-row block the dense regime's
# GEMMs use at these sizes.
SIDE_PROJ_ROWS = 8


def _kernel_rows(name: str, default: int) -> int:
    return integer(f"KESTREL_JAX_GEMV_{name}_ROWS", default, high=64)


def qkv_kernel_rows() -> int:
    return _kernel_rows("QKV", QKV_KERNEL_ROWS)


def proj_kernel_rows() -> int:
    return _kernel_rows("PROJ", PROJ_KERNEL_ROWS)


def region_kernel_rows() -> int:
    return _kernel_rows("REGION", REGION_KERNEL_ROWS)


def dense_proj_kernel() -> bool:
    """Whether dense layers (MD2's every layer, MD3's first four) also run their decode output
    projection through the decode GEMM kernel (at most `proj_kernel_rows()` rows), as MoE layers
    do; their QKV stays in XLA, merged with fc1. KESTREL_JAX_DENSE_PROJ_GEMV (read at trace time),
    default 1: at one row XLA's product is a two-row split-K GEMM after a pad launch (MD3 batch-1
    step, H100, twenty-second session: 1,664.5 -> 1,660.6 us CUPTI, wall 3,082.6 -> 3,075.3, the
    hidden states bit-identical); 0 keeps XLA's."""
    return flag("KESTREL_JAX_DENSE_PROJ_GEMV", True)


class KVCache(NamedTuple):
    """Per-layer paged pools (layout: `kestrel_jax.pallas.paged_attention`) and their scales."""

    k: tuple[jax.Array, ...]  # L x [P, Hkv, S, Dh]
    v: tuple[jax.Array, ...]  # L x [P, Hkv, S, Dh]
    k_scale: jax.Array  # [L] f32 (ignored unless the pool is FP8)
    v_scale: jax.Array  # [L] f32

    @property
    def page_size(self) -> int:  # pages are [P, Hkv, S, Dh] (head-major)
        return int(self.k[0].shape[2])

    @property
    def num_pages(self) -> int:
        return int(self.k[0].shape[0])


class DecodeRows(NamedTuple):
    """The decode rows that lead a mixed pass: token rows [0, rows) are one new position each of
    `rows` decoding sequences (padding rows: slot -1, kv_len 0)."""

    rows: int  # static
    kv_lens: jax.Array  # [rows] int32 length after this pass
    page_table: jax.Array  # [rows, max_pages] int32


class AttentionBatch(NamedTuple):
    """Where the T tokens of one forward pass sit. Decode when `cu_q_lens` is None (T == B).

    Prefill: tokens of B sequences flattened in order; `cu_q_lens[b]:cu_q_lens[b+1]` are sequence
    b's new tokens, `kv_lens[b]` its total length after this pass, `prefix_lens[b]` its
    bidirectional prefix (730 with an image). Padding tokens have slot -1.
    Mixed (`decode` set): the first `decode.rows` tokens are decode rows, attended by the decode
    kernel; the prefill fields (cu_q_lens offsets included) describe the tokens after them.
    `positions` and `slots` cover all T tokens.
    """

    positions: jax.Array  # [T] int32 absolute positions
    slots: jax.Array  # [T] int32 flat KV slot (page * page_size + offset), -1 = padding
    kv_lens: jax.Array  # [B] int32
    page_table: jax.Array  # [B, max_pages] int32
    cu_q_lens: jax.Array | None = None  # [B + 1] int32 (prefill only)
    prefix_lens: jax.Array | None = None  # [B] int32 (prefill only)
    # Rows >= num_valid are padding (MoE skips their expert reads). None: all rows are real.
    num_valid: jax.Array | None = None  # [] int32
    decode: DecodeRows | None = None


class TauScaling(nnx.Module):
    """MD3 per-head learned temperature on Q and V (MOONDREAM.md §3.3.2; the math is
    `qkv_epilogue.qkv_heads_ref` and the decode kernel beside it)."""

    def __init__(self, cfg: TextConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.wq = nnx.Param(init(rngs.params(), (cfg.n_heads, cfg.qkv_dim), dtype))
        self.wv = nnx.Param(init(rngs.params(), (cfg.n_heads, cfg.qkv_dim), dtype))
        self.alpha = nnx.Param(jnp.zeros((cfg.n_heads,), dtype))

    def weights(self) -> TauWeights:
        return TauWeights(self.wq[...], self.wv[...], self.alpha[...])


class Attention(nnx.Module):
    def __init__(self, cfg: TextConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs, decode_gemm_kernel: bool = False):
        self.cfg = cfg
        # Decode-size QKV / output projections through `gemv_mgpu` (GPU only). MoE layers only: in a
        # dense layer XLA merges the QKV product with fc1 (same LayerNorm input) into one GEMM,
        # which taking QKV out of XLA would split (MD2 batch-1 decode 642 -> 588 tok/s, fifth session).
        self.decode_gemm_kernel = decode_gemm_kernel
        self.qkv = Linear(cfg.dim, cfg.qkv_dim, dtype=dtype, rngs=rngs)
        self.proj = Linear(cfg.dim, cfg.dim, dtype=dtype, rngs=rngs)
        self.tau = TauScaling(cfg, dtype=dtype, rngs=rngs) if cfg.tau else None

    def __call__(
        self,
        x: jax.Array,  # [T, D] normalised input
        batch: AttentionBatch,
        k_pages: jax.Array,
        v_pages: jax.Array,
        k_scale: jax.Array,
        v_scale: jax.Array,
        aux: dict[str, jax.Array] | None,
        router: Linear | None = None,
        *,
        route_top_k: int | None = None,
        experts: ExpertWeights | None = None,
        u: jax.Array | None = None,
        u_wide: jax.Array | None = None,
        project: bool = True,
        partials: bool = False,
        pre: tuple[jax.Array, jax.Array, TauDots | None] | None = None,
    ) -> tuple[jax.Array | tuple[jax.Array, jax.Array], jax.Array, jax.Array, jax.Array | DenseRoute | None]:
        """-> (output, k_pages, v_pages, router logits, routing tables or None). With `router` (the
        MoE layer's, which reads the same normalised input), decode on a GPU computes its logits in
        the QKV product's launch (rows past the batch's may follow: x's padding rows' logits); with
        `route_top_k` as well, the QKV epilogue's launch may turn them into the MoE's routing
        tables (`ops.decode_qkv_routed`, a `DenseRoute` returned instead of the logits). x may
        arrive padded past the batch's rows (the decode LayerNorm kernel's normalised rows).
        `experts` (an MoE layer's): what decode attention may ask into L2 for the selected experts
        (`ops.l2_prefetch_mask`). `u`: the QKV product already formed (a dense layer's decode step
        with `Block.dense_w`), else this layer forms it; `u_wide`: the product it is the first
        columns of (`ops.decode_qkv` may read that in place of the slice). `partials` (decode, with
        `project` off): split-KV attention's unmerged partials (o, lse) come back in place of the
        output where the kernel path has them (`ops.decode_attention_partials`), for a later launch
        to merge. `pre`: (QKV rows, router rows, tau dots or None) the layer's LayerNorm launch already
        formed (`qkv_with_ln`), in place of this layer's own QKV + router product."""
        cfg = self.cfg
        t = batch.positions.shape[0]
        hd, h, hkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        decode = batch.cu_q_lens is None and self.decode_gemm_kernel
        logits: jax.Array | None = None
        dots: TauDots | None = None
        if pre is not None:
            u, logits, dots = pre
        elif u is None:
            u, logits, dots = self._qkv(x, t, decode, router)
        tau = self.tau.weights() if self.tau is not None else None
        rot, theta = cfg.rotary_dim, cfg.rope_theta
        # Decode on a GPU: tau, rotary and the KV write in one kernel (captures need the jnp path).
        fused = None
        routed: jax.Array | DenseRoute | None = logits
        if batch.cu_q_lens is None and aux is None:
            if route_top_k is not None and logits is not None:
                out = ops.decode_qkv_routed(u, batch.positions, batch.slots, k_pages, v_pages, k_scale, v_scale, tau,
                                            n_heads=h, rotary_dim=rot, theta=theta, logits=logits,
                                            num_valid=batch.num_valid, top_k=route_top_k, tau_dots=dots)
                if out is not None:
                    fused = out[:3]
                    routed = logits if out[3] is None else out[3]
            else:
                fused = ops.decode_qkv(u, batch.positions, batch.slots, k_pages, v_pages, k_scale, v_scale, tau,
                                       n_heads=h, rotary_dim=rot, theta=theta, tau_dots=dots, wide=u_wide)
        # Prefill and mixed steps on a GPU: rotary, tau and the KV write in one kernel, q coming back
        # as (decode rows', prefill rows') where a mixed step's decode rows lead.
        nd = 0 if batch.decode is None else batch.decode.rows
        q_split: tuple[jax.Array, ...] | None = None
        if batch.cu_q_lens is not None and aux is None:
            out3 = ops.prefill_qkv(u, batch.positions, batch.slots, k_pages, v_pages, k_scale, v_scale, tau,
                                   n_heads=h, rotary_dim=rot, theta=theta, split=nd)
            if out3 is not None:
                q_split, (k_pages, v_pages) = out3[:-2], out3[-2:]
        if fused is not None:
            q, k_pages, v_pages = fused
        elif q_split is not None:
            q = q_split[-1]  # (the attention calls below take q_split's parts)
        else:
            u = u[:t]  # the decode GEMM's rows may come padded (`ops.small_linear_pair`)
            q, k, v = qkv_heads_ref(u, batch.positions, tau, n_heads=h, n_kv_heads=hkv, rotary_dim=rot, theta=theta,
                                    aux=aux, gelu=ops.tau_gelu() if aux is None else gelu_erf)
            if aux is not None:
                aux.update(k=k, v=v)
            k_pages, v_pages = ops.write_kv(k_pages, v_pages, k, v, batch.slots, k_scale, v_scale)
        scale = hd**-0.5
        if batch.cu_q_lens is None:
            pf, pf_experts = self._prefetch(t, routed, experts)
            blocks = t * (route_top_k or 1)
            gemm = decode or dense_proj_kernel()
            if gemm and project:  # the split-KV merge inside the projection's launch (opt-in)
                y = ops.decode_attention_projected(
                    q, k_pages, v_pages, batch.kv_lens, batch.page_table, k_scale, v_scale, self.proj.kernel[...],
                    self.proj.bias[...] if self.proj.bias is not None else None, sm_scale=scale,
                    max_rows=proj_kernel_rows(), prefetch=pf, prefetch_experts=pf_experts, prefetch_max_blocks=blocks)
                if y is not None:
                    return y, k_pages, v_pages, routed
            if partials and not project:
                parts = ops.decode_attention_partials(
                    q, k_pages, v_pages, batch.kv_lens, batch.page_table, k_scale, v_scale, sm_scale=scale,
                    prefetch=pf, prefetch_experts=pf_experts, prefetch_max_blocks=blocks)
                if parts is not None:
                    return parts, k_pages, v_pages, routed
            o = ops.decode_attention(q, k_pages, v_pages, batch.kv_lens, batch.page_table, k_scale, v_scale,
                                     sm_scale=scale, prefetch=pf, prefetch_experts=pf_experts,
                                     prefetch_max_blocks=blocks)
            if not project:
                return o.reshape(t, h * hd), k_pages, v_pages, routed
            return self._project(o.reshape(t, h * hd), gemm), k_pages, v_pages, routed
        else:
            assert batch.prefix_lens is not None
            q_pre = q[nd:] if q_split is None else q_split[-1]
            o = ops.prefill_attention(q_pre, k_pages, v_pages, batch.cu_q_lens, batch.kv_lens,
                                      batch.page_table, batch.prefix_lens, k_scale, v_scale,
                                      sm_scale=scale)
            if batch.decode is not None:  # one query per sequence: the decode kernel's shape
                q_dec = q[:nd] if q_split is None else q_split[0]
                od = ops.decode_attention(q_dec, k_pages, v_pages, batch.decode.kv_lens, batch.decode.page_table,
                                          k_scale, v_scale, sm_scale=scale)
                o = jnp.concatenate([od, o])
            return self._project(o.reshape(t, h * hd), decode), k_pages, v_pages, logits

    def _prefetch(self, t: int, routed: jax.Array | DenseRoute | None, experts: ExpertWeights | None,
                  ) -> tuple[tuple[jax.Array, ...], tuple[tuple[jax.Array, jax.Array], ...]]:
        """What decode attention asks into L2 for the GEMMs after it (`ops.l2_prefetch_mask`): the
        output projection's weight, the selected experts' up (and down) weights with the routing
        tables' block tables."""
        mask = ops.l2_prefetch_mask() if t <= ops.PREFETCH_MAX_ROWS else 0
        prefetch = (self.proj.kernel[...],) if mask & 1 else ()
        targets: tuple[tuple[jax.Array, jax.Array], ...] = ()
        if mask & 2 and experts is not None and isinstance(routed, DenseRoute):
            targets = ((experts.up_w, routed.meta_up),)
            if mask & 16:
                targets += ((experts.down_w, routed.meta_down),)
        return prefetch, targets

    def qkv_with_ln(self, x: jax.Array, ln: LayerNorm, router: Linear, experts: ExpertWeights,
                    residual: ops.PendingResidual | None = None,
                    ) -> tuple[tuple[jax.Array, jax.Array, TauDots | None], jax.Array, jax.Array | None] | None:
        """A decode MoE layer's LayerNorm of the residual stream x and this attention's QKV + router
        products in one launch (`ops.decode_ln_qkv_router`): ((QKV rows, router rows, tau dots or
        None) for `__call__`'s `pre`, the normalised rows, None), all padded to the row tile; with
        `residual` the launch adds the previous layer's output first, and the new residual stream
        row is the third item. None where that launch does not apply (then the LayerNorm and `_qkv`
        run as they did)."""
        if not self.decode_gemm_kernel:
            return None
        qkv_b = self.qkv.bias[...] if self.qkv.bias is not None else None
        out = ops.decode_ln_qkv_router(
            x, ln.scale[...], ln.bias[...], self.qkv.kernel[...], qkv_b, router.kernel[...],
            router.bias[...] if router.bias is not None else None, experts, eps=ln.eps, max_rows=qkv_kernel_rows(),
            tau=self.tau.weights() if self.tau is not None else None, residual=residual)
        return None if out is None else (out[:3], out[3], out[4] if len(out) > 4 else None)

    @staticmethod
    def _linear(layer: Linear, x: jax.Array, kernel_rows: int, rows: int | None = None,
                splits: int | None = None, stages: int = 4) -> jax.Array | None:
        """`layer(x)` through the decode GEMM kernel (at most `kernel_rows` rows, on a GPU), else None."""
        bias = layer.bias[...] if layer.bias is not None else None
        return ops.small_linear(x, layer.kernel[...], bias, max_rows=kernel_rows, rows=rows, splits=splits,
                                stages=stages)

    def _qkv(self, x: jax.Array, t: int, decode: bool,
             router: Linear | None) -> tuple[jax.Array, jax.Array | None, TauDots | None]:
        """(QKV product, router logits or None, MD3's tau dots formed in the same launch or None)."""
        if decode and router is not None:
            pair = ops.small_linear_pair(
                x, self.qkv.kernel[...], self.qkv.bias[...] if self.qkv.bias is not None else None,
                router.kernel[...], router.bias[...] if router.bias is not None else None, max_rows=qkv_kernel_rows(),
                rows=t, padded_ok=True, tau=self.tau.weights() if self.tau is not None else None)
            if pair is not None:
                return pair
        y = self._linear(self.qkv, x, qkv_kernel_rows(), rows=t) if decode else None
        return (self.qkv(x[:t]) if y is None else y), None, None

    def _project(self, o: jax.Array, decode: bool) -> jax.Array:
        """Output projection. At decode on a GPU, the decode GEMM kernel. Otherwise, with a single
        row, XLA's GPU simplifier rewrites a [1, D] x [D, D] dot below its size threshold into
        multiply + reduce, which materialises a [D, D] product (3x the weight bytes per decode
        step). Two rows keep it a GEMM; the barrier stops the slice from being pushed back into the
        dot."""
        if decode:
            splits, stages = ops.proj_gemv_tuning()
            y = self._linear(self.proj, o, proj_kernel_rows(), splits=splits, stages=stages)
            if y is not None:
                return y
        if o.shape[0] != 1:
            return self.proj(o)
        y = jax.lax.optimization_barrier(self.proj(jnp.pad(o, ((0, 1), (0, 0)))))
        return y[:1]


class MoE(nnx.Module):
    """64-expert top-8 FFN; experts stored `[E, out, in]` (bf16, or e4m3 + per-row scales)."""

    def __init__(self, cfg: TextConfig, *, dtype: jnp.dtype, fp8_experts: bool, rngs: nnx.Rngs):
        assert cfg.moe is not None
        e, inner, d = cfg.moe.num_experts, cfg.moe.expert_inner_dim, cfg.dim
        self.top_k = cfg.moe.experts_per_token
        self.router = Linear(d, e, dtype=dtype, rngs=rngs)
        init = nnx.initializers.normal(0.02)
        wdt = jnp.float8_e4m3fn if fp8_experts else dtype
        self.fc1 = nnx.Param(init(rngs.params(), (e, 2 * inner, d), jnp.float32).astype(wdt))
        self.fc2 = nnx.Param(init(rngs.params(), (e, d, inner), jnp.float32).astype(wdt))
        self.fc1_scale = nnx.Param(jnp.ones((e, 2 * inner), jnp.float32)) if fp8_experts else None
        self.fc2_scale = nnx.Param(jnp.ones((e, d), jnp.float32)) if fp8_experts else None

    def experts(self) -> ExpertWeights:
        return ExpertWeights(
            self.fc1[...], self.fc2[...],
            None if self.fc1_scale is None else self.fc1_scale[...],
            None if self.fc2_scale is None else self.fc2_scale[...],
        )

    def __call__(self, x: jax.Array, aux: dict[str, jax.Array] | None,
                 num_valid: jax.Array | None = None, logits: jax.Array | None = None) -> jax.Array:
        router_w = self.router.kernel[...]
        router_b = self.router.bias[...] if self.router.bias is not None else jnp.zeros(router_w.shape[1])
        if aux is not None:
            routing = ops.route(x, router_w, router_b, self.top_k)
            aux.update(router_logits=routing.logits, topk_idx=routing.experts, topk_weight=routing.weights)
        return ops.moe_layer(x, router_w, router_b, self.experts(), top_k=self.top_k, num_valid_tokens=num_valid,
                             logits=logits)

    def rows(self, x: jax.Array, num_valid: jax.Array | None, logits: jax.Array | None,
             tokens: int, x_f16: jax.Array | None = None, route: DenseRoute | None = None,
             side: tuple[Any, jax.Array] | None = None, side_row0: bool = False) -> ExpertRows | None:
        """The layer's expert rows before the weighted sum (decode on a GPU; x may be padded past
        `tokens` rows, `x_f16` its f16 copy for W8A16 experts, `route` its routing tables when the
        QKV epilogue built them, `side` a product for the down GEMM's launch, its partials then in
        `ExpertRows.side`, row 0's alone with `side_row0`), or None where the kernel path does not
        produce them."""
        router_w = self.router.kernel[...]
        router_b = self.router.bias[...] if self.router.bias is not None else jnp.zeros(router_w.shape[1])
        return ops.moe_layer_rows(x, router_w, router_b, self.experts(), top_k=self.top_k, num_valid_tokens=num_valid,
                                  logits=logits, tokens=tokens, x_f16=x_f16, route=route, side=side,
                                  **({"side_row0": True} if side_row0 else {}))


class DenseIn(nnx.Variable):
    """A dense layer's QKV and fc1 weights (or biases) side by side, [D, QKV + F] (or [QKV + F]):
    the decode steps' one product over the normalised rows; or its output projection's and fc2's
    weights stacked, [D + F, D] (and their biases summed, [D]): the one product over attention's
    output and GELU(fc1) side by side (`TextModel.fuse_dense_decode`)."""


class Block(nnx.Module):
    def __init__(self, cfg: TextConfig, layer: int, *, dtype: jnp.dtype, fp8_experts: bool, rngs: nnx.Rngs):
        self.ln = LayerNorm(cfg.dim, eps=cfg.ln_eps, dtype=dtype)
        self.attn = Attention(cfg, dtype=dtype, rngs=rngs, decode_gemm_kernel=cfg.is_moe_layer(layer))
        self.mlp: MoE | MLP
        if cfg.is_moe_layer(layer):
            self.mlp = MoE(cfg, dtype=dtype, fp8_experts=fp8_experts, rngs=rngs)
        else:
            self.mlp = MLP(cfg.dim, cfg.ff_dim, cfg.dim, dtype=dtype, rngs=rngs)
        # weight and bias side by side: `TextModel.fuse_dense_decode`
        self.dense_w: DenseIn | None = nnx.data(None)
        self.dense_b: DenseIn | None = nnx.data(None)
        self.dense_out_w: DenseIn | None = nnx.data(None)
        self.dense_out_b: DenseIn | None = nnx.data(None)

    def dense_decode_in(self, n: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array] | None:
        """A dense layer's decode (QKV product, fc1 product, the joined product they are slices
        of) from one GEMM over `dense_w`; None without it."""
        if self.dense_w is None or self.dense_b is None:
            return None
        splits, _, stages = ops.dense_decode_gemv()
        y = ops.small_linear(n, self.dense_w[...], self.dense_b[...], max_rows=DENSE_GEMV_ROWS, splits=splits,
                             stages=stages, row_major=n.shape[0] == DENSE_GEMV_ROWS) if splits else None
        if y is None:
            y = jnp.dot(n, self.dense_w[...].astype(n.dtype)) + self.dense_b[...].astype(n.dtype)
        split = self.attn.qkv.kernel.shape[1]
        return y[:, :split], y[:, split:], y

    def dense_in_with_ln(self, x: jax.Array, residual: ops.PendingResidual | None = None
                         ) -> tuple[tuple[jax.Array, jax.Array, jax.Array], jax.Array, jax.Array | None] | None:
        """A dense layer's one-row decode LayerNorm of the residual stream x and its joined QKV +
        fc1 product in one launch (`ops.decode_ln_dense_in`, on by default): ((QKV product, fc1 product,
        the joined product) as `dense_decode_in` gives them, the normalised rows, None); the QKV slice
        and the fc1 slice of row 0, the joined product padded to 8 rows (the QKV epilogue reads row
        0's QKV columns in place). With `residual` (x is then its x) the same launch adds the previous
        layer's output first, and the new residual stream row is the third item. None where that
        launch does not apply."""
        if self.dense_w is None or self.dense_b is None:
            return None
        out = ops.decode_ln_dense_in(x, self.ln.scale[...], self.ln.bias[...], self.dense_w[...], self.dense_b[...],
                                     eps=self.ln.eps, residual=residual)
        if out is None:
            return None
        y, n, *x_new = out
        split = self.attn.qkv.kernel.shape[1]
        return (y[:1, :split], y[:1, split:], y), n, (x_new[0] if x_new else None)

    def dense_decode_out(self, o: jax.Array, h: jax.Array) -> jax.Array:
        """A dense layer's decode output projection of attention's output `o` plus its MLP's
        fc2(GELU_tanh(h)) (h: the fc1 product), as one product over `dense_out_w` ([proj; fc2]
        stacked along the input dimension) with the two biases summed: one GEMM and one pass over
        its split-K partial sums instead of two of each (the sum is rounded to bf16 once, not each
        term)."""
        assert self.dense_out_w is not None and self.dense_out_b is not None
        g = self._dense_out_row(o, h)
        stages = ops.dense_decode_gemv()[2]
        # The kernel at 64 rows, where it forms y's partials, not y^T's: with the transposed ones XLA
        # carried the residual stream transposed into the next LayerNorm, whose row statistics then
        # read it strided (H200, forty-third session: 1.5 -> 5.1 us per layer; an optimization
        # barrier on y did not stop it). At one row y and y^T are the same vector.
        rows = g.shape[0]
        splits = ops.dense_out_splits(g.shape[1], one_row=rows == 1) if rows in (1, DENSE_GEMV_ROWS) else 0
        row_major = rows == DENSE_GEMV_ROWS
        y = ops.small_linear(g, self.dense_out_w[...], self.dense_out_b[...], max_rows=DENSE_GEMV_ROWS,
                             splits=splits, stages=stages, row_major=row_major) if splits else None
        if y is not None:
            return y
        return jnp.dot(g, self.dense_out_w[...].astype(g.dtype)) + self.dense_out_b[...].astype(g.dtype)

    @staticmethod
    def _dense_out_row(o: jax.Array, h: jax.Array) -> jax.Array:
        return jnp.concatenate([o, gelu_tanh(h)], axis=1)

    def dense_decode_out_pending(self, x: jax.Array, o: jax.Array, h: jax.Array) -> ops.PendingResidual | None:
        """`x + dense_decode_out(o, h)` at one row, left for the next dense layer's rows kernel to add
        (`ops.dense_residual_in_rows_wanted`): the joined product's row-0 split partials with the
        stream and the bias; None where that does not apply."""
        assert self.dense_out_w is not None and self.dense_out_b is not None
        out = ops.dense_out_row0(self._dense_out_row(o, h), self.dense_out_w[...], self.dense_out_b[...])
        return None if out is None else ops.PendingResidual(x, *out)


class KVScales(nnx.Variable):
    """Per-layer (k_scale, v_scale) for an FP8 KV cache, from the checkpoint when it has them."""


class TextModel(nnx.Module):
    def __init__(self, cfg: TextConfig, *, dtype: jnp.dtype, fp8_experts: bool = False, rngs: nnx.Rngs):
        self.cfg = cfg
        self.wte = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (cfg.vocab_size, cfg.dim), dtype))
        self.blocks = nnx.List([
            Block(cfg, i, dtype=dtype, fp8_experts=fp8_experts, rngs=rngs) for i in range(cfg.n_layers)
        ])
        self.post_ln = LayerNorm(cfg.dim, eps=cfg.ln_eps, dtype=dtype)
        self.lm_head = Linear(cfg.dim, cfg.vocab_size, dtype=dtype, rngs=rngs)
        self.kv_scales = KVScales(jnp.ones((cfg.n_layers, 2), jnp.float32))

    def fuse_dense_decode(self, on: bool = True, device: jax.Device | None = None) -> int:
        """Give each dense layer (MD2's every layer, MD3's first four) its QKV and fc1 weights side
        by side (`Block.dense_w`, `dense_b`), which its decode steps then read as one product, and
        its output projection's and fc2's stacked (`Block.dense_out_w`, `dense_out_b`; not with
        KESTREL_JAX_DENSE_OUT_JOINED=0), read as one product too; off removes them. Copies: the
        separate weights stay for prefill (MD2 at full size: +1.4 GB and +1.0 GB). -> bytes added.
        Why: XLA merges the two input products into one GEMM anyway, concatenating the weights
        inside its Triton GEMM as it reads them; joined once here, the product is a plain GEMM that
        cuBLAS can run too (H200, 64 rows: 19.1 us against 22.5 per MD2 layer). The two output
        products were two split-K GEMMs, each with its partial sums to add (H200, 64 rows: 17.6 +
        GELU and sum passes 8.6 us per MD2 layer; joined 15.1 + 5.4).
        `device`: where the joined copies are made (default: where the weights are)."""
        added = 0
        out = flag("KESTREL_JAX_DENSE_OUT_JOINED", True)
        for block in self.blocks:
            if not isinstance(block.mlp, MLP) or not on:
                block.dense_w = block.dense_b = block.dense_out_w = block.dense_out_b = None
                continue
            qkv, fc1 = block.attn.qkv, block.mlp.fc1
            dt = qkv.kernel[...].dtype
            parts = [qkv.kernel[...], fc1.kernel[...],
                     qkv.bias[...] if qkv.bias is not None else jnp.zeros(qkv.kernel.shape[1], dt),
                     fc1.bias[...] if fc1.bias is not None else jnp.zeros(fc1.kernel.shape[1], dt)]
            if device is not None:
                parts = [jax.device_put(a, device) for a in parts]
            w = jnp.concatenate(parts[:2], axis=1)
            b = jnp.concatenate(parts[2:])
            block.dense_w, block.dense_b = DenseIn(w), DenseIn(b.astype(w.dtype))
            added += w.nbytes + b.nbytes
            block.dense_out_w = block.dense_out_b = None
            if not out:
                continue
            proj, fc2 = block.attn.proj, block.mlp.fc2
            outs = [proj.kernel[...], fc2.kernel[...]]
            ob = sum((lin.bias[...].astype(jnp.float32) for lin in (proj, fc2) if lin.bias is not None),
                     jnp.zeros(proj.kernel.shape[1], jnp.float32))
            if device is not None:
                outs, ob = [jax.device_put(a, device) for a in outs], jax.device_put(ob, device)
            wo = jnp.concatenate(outs, axis=0)
            block.dense_out_w, block.dense_out_b = DenseIn(wo), DenseIn(ob.astype(wo.dtype))
            added += wo.nbytes + wo.shape[1] * wo.dtype.itemsize
        return added

    def embed(self, ids: jax.Array, dtype: jnp.dtype) -> jax.Array:  # [T] -> [T, D]
        return self.wte[...][ids].astype(dtype)

    def __call__(
        self,
        x: jax.Array,  # [T, D] input embeddings
        batch: AttentionBatch,
        cache: KVCache,
        *,
        capture: bool = False,
    ) -> tuple[jax.Array, KVCache, list[dict[str, jax.Array]]]:
        """Run all blocks. Returns (hidden before post_ln [T, D], new cache, captures).

        With `capture`, one dict per layer: `block_inputs`, `k`/`v` (post-rotary K, post-tau V),
        MD3 `tau_q`/`tau_v`/`tau_pos` and, in MoE layers, `router_logits`/`topk_idx`/`topk_weight`.
        """
        ks, vs = list(cache.k), list(cache.v)
        captured: list[dict[str, jax.Array]] = []
        t = x.shape[0]
        pad_rows = -(-t // 8) * 8  # the decode GEMM's and the MoE block's row tile
        n_next: jax.Array | None = None  # this layer's LayerNorm output, from the previous layer's kernel
        n16_next: jax.Array | None = None  # and its f16 copy, where that kernel formed one
        # prefill and mixed steps: `ops.residual_layer_norm` (captures keep the jnp expressions)
        block_ln = batch.cu_q_lens is not None and not capture
        # a one-row residual add left to the next layer's rows kernel (`ops.dense_residual_in_rows_wanted`,
        # `ops.moe_residual_in_rows_wanted`)
        pending: ops.PendingResidual | None = None
        for i, block in enumerate(self.blocks):
            aux: dict[str, jax.Array] | None = {} if capture else None
            moe = isinstance(block.mlp, MoE)
            ln_kernel = aux is None and batch.cu_q_lens is None and t <= qkv_kernel_rows()
            if pending is not None and (moe != (pending.expert is not None) or not ln_kernel or t != 1
                                        or n_next is not None):
                x, pending = ops.add_residual(pending), None  # (not made for such a layer: a safeguard)
            if aux is not None:
                aux["block_inputs"] = x
            n16, n16_next = n16_next, None  # the MoE's f16 operand rows, when a LayerNorm kernel formed them
            pre: tuple[jax.Array, jax.Array, TauDots | None] | None = None  # QKV + router formed with the LayerNorm
            dense_pre: tuple[jax.Array, jax.Array, jax.Array] | None = None  # a dense layer's, likewise
            if n_next is None and moe and ln_kernel:
                assert isinstance(block.mlp, MoE)
                # on by default (`ops.ln_in_rows_wanted`): the LayerNorm inside the QKV + router rows kernel
                with_ln = block.attn.qkv_with_ln(x, block.ln, block.mlp.router, block.mlp.experts(), pending)
                if with_ln is None and pending is not None:  # the rows kernel refused it: XLA's add
                    x, pending = ops.add_residual(pending), None
                    with_ln = block.attn.qkv_with_ln(x, block.ln, block.mlp.router, block.mlp.experts())
                if with_ln is not None:
                    pre, n_next, x_new = with_ln
                    if x_new is not None:  # the residual added in that launch
                        x, pending = x_new, None
                else:
                    ln_rows = ops.decode_moe_layer_norm(x, block.ln.scale[...], block.ln.bias[...],
                                                        block.mlp.experts(), eps=block.ln.eps, pad_rows=pad_rows)
                    if ln_rows is not None:
                        n_next, n16 = ln_rows
                if n_next is not None:
                    # x is materialised here anyway (the kernel reads it): the barrier keeps XLA from
                    # recomputing earlier layers' residual adds inside this layer's (H100: with the
                    # kernel and no barrier, each residual fusion took ~1.5 us longer).
                    x = jax.lax.optimization_barrier(x)
            elif n_next is None and ln_kernel and t == 1 and not moe:  # a dense layer's, in one launch
                # on by default (`ops.dense_ln_in_rows_wanted`): inside the rows kernel of the joined QKV + fc1 product
                dense_ln = block.dense_in_with_ln(x, pending) if ops.dense_in_one_row() else None
                if dense_ln is None and pending is not None:  # the rows kernel refused it: XLA's add
                    x, pending = ops.add_residual(pending), None
                    dense_ln = block.dense_in_with_ln(x) if ops.dense_in_one_row() else None
                if dense_ln is not None:
                    dense_pre, n_next, x_new = dense_ln
                    if x_new is not None:  # the residual added in that launch
                        x, pending = x_new, None
                else:
                    n_next = ops.decode_dense_layer_norm(x, block.ln.scale[...], block.ln.bias[...],
                                                         eps=block.ln.eps)
                if n_next is not None:
                    x = jax.lax.optimization_barrier(x)  # as above
            if n_next is None and block_ln:  # the first block of a prefill or mixed step
                _, n_next = ops.residual_layer_norm(x, (), block.ln.scale[...], block.ln.bias[...], eps=block.ln.eps)
            n = block.ln(x) if n_next is None else n_next  # [T or pad_rows, D]
            n_next = None
            router = block.mlp.router if isinstance(block.mlp, MoE) else None
            # The expert rows path (below: MoE layers whose rows a LayerNorm kernel formed, padded)
            # takes routing tables built in the QKV epilogue's launch.
            rows_path = isinstance(block.mlp, MoE) and (n16 is not None or n.shape[0] != t)
            top_k = block.mlp.top_k if isinstance(block.mlp, MoE) and rows_path else None
            # a dense layer's decode step: QKV and fc1 in one product over weights joined at load time
            # (XLA merges the two products anyway, joining the weights at run time inside its GEMM).
            # At one row the QKV epilogue reads its columns in place (without that the products' slices
            # became copies of their own: H200, session 35, batch-1 step +22.8 us); on by default
            # (MD2's layers: step -3.1%; MD3's four, tau over the QKV columns: W1 +0.9%),
            # `ops.dense_in_one_row`.
            joined = batch.cu_q_lens is None and aux is None and (t > 1 or ops.dense_in_one_row())
            dense_in = dense_pre if dense_pre is not None else block.dense_decode_in(n[:t]) if joined else None
            # (at one row as `ops.dense_out_one_row` asks, whichever way the input product was formed)
            out_joined = dense_in is not None and block.dense_out_w is not None and (t > 1 or ops.dense_out_one_row())
            # one row: the output projection and fc2 still as one product over the joined weights,
            # fc1 formed on its own (XLA merges it with the QKV product; `ops.dense_out_one_row`)
            h_one: jax.Array | None = None
            if (batch.cu_q_lens is None and aux is None and t == 1 and block.dense_out_w is not None
                    and dense_in is None and isinstance(block.mlp, MLP) and ops.dense_out_one_row()):
                h_one = block.mlp.fc1(n[:t])
            # the output projection streamed in the MoE down GEMM's launch (`ops.proj_in_down_wanted`),
            # unless the opt-in merged projection (attention's split-KV merge in its launch) asks for it
            side_proj = (rows_path and block.attn.decode_gemm_kernel and t <= SIDE_PROJ_ROWS
                         and ops.proj_in_down_wanted() and not ops.merged_projection_wanted())
            a_out, ks[i], vs[i], routed = block.attn(
                n, batch, ks[i], vs[i], cache.k_scale[i], cache.v_scale[i], aux, router=router, route_top_k=top_k,
                experts=block.mlp.experts() if isinstance(block.mlp, MoE) else None,
                u=None if dense_in is None else dense_in[0], u_wide=None if dense_in is None else dense_in[2],
                project=not (out_joined or h_one is not None or side_proj),
                partials=side_proj and ops.merge_in_up_wanted(), pre=pre)
            # split-KV partials (`ops.merge_in_up_wanted`): the up GEMM's launch merges them for the
            # projection's side product; where it does not, the merge here feeds the projection below
            # (where it does, nothing reads this merge and XLA drops it: the H200 step listings of the
            # forty-eighth session show no merge fusion left)
            parts: tuple[jax.Array, jax.Array] | None = None
            if isinstance(a_out, tuple):
                parts, a = a_out, ops.merge_partials(a_out, t, n.dtype)
            else:
                a = a_out
            logits, route = (None, routed) if isinstance(routed, DenseRoute) else (routed, None)
            rows = None
            nxt_block = self.blocks[i + 1] if i + 1 < len(self.blocks) else None
            # (on by default) this MoE layer's residual add inside the next MoE layer's rows kernel, from
            # the projection's row-0 partials (streamed by the down GEMM) and the unreduced expert rows;
            # at one row it comes before the opt-in residual + LayerNorm launch below
            moe_pend = (t == 1 and ln_kernel and side_proj and nxt_block is not None
                        and isinstance(nxt_block.mlp, MoE) and nxt_block.attn.decode_gemm_kernel
                        and ops.moe_residual_in_rows_wanted() and ops.ln_in_rows_wanted())
            if isinstance(block.mlp, MoE) and rows_path:
                side = None
                if side_proj and parts is not None:
                    side = (ops.merged_rows(parts, t), block.attn.proj.kernel[...])
                elif side_proj:
                    side = (jnp.pad(a, ((0, SIDE_PROJ_ROWS - t), (0, 0))), block.attn.proj.kernel[...])
                rows = block.mlp.rows(n, batch.num_valid, logits, t, x_f16=n16, route=route, side=side,
                                      side_row0=moe_pend)
                if moe_pend and rows is not None and rows.side is not None:
                    proj_b = block.attn.proj.bias
                    pending = ops.PendingResidual(x, rows.side, None if proj_b is None else proj_b[...].astype(x.dtype),
                                                  (rows.y, rows.dest, rows.weights, rows.n_valid))
                    continue
            if side_proj:  # `a` is attention's output: its projection from the down GEMM's partials, or here
                proj = block.attn.proj
                bias = proj.bias[...] if proj.bias is not None else None
                a = (ops.side_product_result(rows.side, t, bias, a.dtype) if rows is not None and rows.side is not None
                     else block.attn._project(a, True))
            if rows is not None and ln_kernel and nxt_block is not None and isinstance(nxt_block.mlp, MoE):
                # opt-in: the residual and the next MoE layer's LayerNorm in one launch
                ended = ops.decode_residual_layer_norm(x, a, rows, nxt_block.ln.scale[...], nxt_block.ln.bias[...],
                                                       nxt_block.mlp.experts(), eps=nxt_block.ln.eps,
                                                       pad_rows=pad_rows)
                if ended is not None:
                    x, n_next, n16_next = ended
                    continue
            if rows is not None:
                m = combine_rows(rows, t, x.dtype)
            elif out_joined and dense_in is not None:  # `a`: attention's output before its projection
                if (t == 1 and ln_kernel and nxt_block is not None and not isinstance(nxt_block.mlp, MoE)
                        and nxt_block.dense_w is not None and ops.dense_in_one_row()):
                    # (on by default) the residual add inside the next dense layer's rows kernel
                    pending = block.dense_decode_out_pending(x, a, dense_in[1])
                    if pending is not None:
                        continue
                x = x + block.dense_decode_out(a, dense_in[1])
                continue
            elif h_one is not None:
                x = x + block.dense_decode_out(a, h_one)
                continue
            elif dense_in is not None and isinstance(block.mlp, MLP):  # MLP.__call__ from its fc1 product
                m = block.mlp.fc2(gelu_tanh(dense_in[1]))
            else:
                m = block.mlp(n[:t], aux, batch.num_valid, logits) if isinstance(block.mlp, MoE) else \
                    block.mlp(self._dense_input(n[:t], batch))
            if block_ln and nxt_block is not None:
                # the residual and the next block's LayerNorm in one launch on a GPU
                x, n_next = ops.residual_layer_norm(x, (a, m), nxt_block.ln.scale[...], nxt_block.ln.bias[...],
                                                    eps=nxt_block.ln.eps)
            else:
                x = (x + a) + m
            if aux is not None:
                captured.append(aux)
        if pending is not None:  # (made only with a next layer: a safeguard)
            x = ops.add_residual(pending)
        new_cache = KVCache(tuple(ks), tuple(vs), cache.k_scale, cache.v_scale)
        return x, new_cache, captured

    @staticmethod
    def _dense_input(n: jax.Array, batch: AttentionBatch) -> jax.Array:
        """A dense layer's MLP input: behind an optimization barrier in prefill steps when
        `ops.split_dense_prefill_gemms` (the QKV and fc1 products then stay two GEMMs instead of
        one over weights concatenated at run time)."""
        if batch.cu_q_lens is not None and ops.split_dense_prefill_gemms():
            return jax.lax.optimization_barrier(n)
        return n

    def logits(self, hidden: jax.Array) -> jax.Array:  # [N, D] -> [N, V] float32
        return self.model_logits(hidden).astype(jnp.float32)

    def model_logits(self, hidden: jax.Array) -> jax.Array:  # [N, D] -> [N, V] in the model's dtype
        """The LM head's logits as it forms them (bf16 for a bf16 model): `logits` before the cast,
        for consumers that widen them themselves (the sampler), so that no pass of its own does. A
        one-row step's `post_ln` runs as the dense layers' one-row LayerNorm does (one launch on a
        GPU, `ops.decode_dense_layer_norm`, instead of XLA's two)."""
        ln = self.post_ln
        n = None
        if hidden.shape[0] == 1:
            n = ops.decode_dense_layer_norm(hidden, ln.scale[...], ln.bias[...], eps=ln.eps)
        return self.lm_head(ln(hidden) if n is None else n)
