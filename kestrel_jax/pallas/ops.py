"""The one interface through which the model reaches attention and MoE.

Each op picks the Pallas kernel on a GPU (when the kernel supports the shapes) and the pure-jnp
reference elsewhere. `use_backend("reference")` forces the references (parity runs, CPU tests).
The choice is made at trace time, so it is baked into each jitted function.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

from kestrel_jax.models.layers import Linear, gelu_erf, gelu_tanh
from kestrel_jax.pallas import moe as moe_ref_mod
from kestrel_jax.pallas import paged_attention as attn_ref_mod
from kestrel_jax.pallas.decode_residual import ExpertRows
from kestrel_jax.pallas.moe import ExpertWeights, Routing
from kestrel_jax.switches import choice, flag, integer

if TYPE_CHECKING:  # the kernel modules load Mosaic GPU: imported where used
    from kestrel_jax.pallas.gemv_mgpu import Gate

Backend = Literal["auto", "reference", "kernel"]
_state = threading.local()


def current_backend() -> Backend:
    return getattr(_state, "backend", "auto")


@contextlib.contextmanager
def use_backend(backend: Backend) -> Iterator[None]:
    if backend not in ("auto", "reference", "kernel"):
        raise ValueError(f"unknown kernel backend {backend!r}; use auto, reference or kernel")
    prev = current_backend()
    _state.backend = backend
    try:
        yield
    finally:
        _state.backend = prev


@functools.cache
def _jitted(fn: Any, static: tuple[str, ...] = ()) -> Any:
    """Kernel entry points wrapped in `jax.jit`: a model calls each kernel once per layer with the
    same shapes, and JAX lowers a jitted callee once per (function, shapes) within one trace, so
    the Mosaic lowering is done once instead of once per layer (start-up time). XLA inlines it."""
    return jax.jit(fn, static_argnames=static)


def _want_kernel() -> bool:
    b = current_backend()
    if b == "reference":
        return False
    if b == "kernel":
        return True
    return jax.default_backend() == "gpu"


# --------------------------------------------------------------------------------------------
# Attention


def write_kv(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array,
             k_scale: jax.Array, v_scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    if _want_kernel():
        from kestrel_jax.pallas import paged_attention_mgpu as kern

        if kern.write_kv_kernel_supported(k_pages, k):
            return _jitted(kern.write_kv_kernel)(k_pages, v_pages, k, v, slots, k_scale, v_scale)
    return attn_ref_mod.write_kv_ref(k_pages, v_pages, k, v, slots, k_scale, v_scale)


def decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, kv_lens: jax.Array,
                     page_table: jax.Array, k_scale: jax.Array, v_scale: jax.Array, *, sm_scale: float,
                     prefetch: tuple[jax.Array, ...] = (),
                     prefetch_experts: tuple[tuple[jax.Array, jax.Array], ...] = (),
                     prefetch_max_blocks: int = 8) -> jax.Array:
    """Paged decode attention. On the kernel path the CTAs also ask `prefetch` (weights the step
    reads next) and `prefetch_experts` (pairs (expert weights, their block table): the selected
    experts' weights, at most `prefetch_max_blocks` blocks) into L2 (`l2_prefetch`); the reference
    ignores them (they change no value)."""
    if _want_kernel():
        from kestrel_jax.pallas import paged_attention_mgpu as kern

        if kern.decode_attention_kernel_supported(q, k_pages, page_table):
            out = _attention_kernel(q, k_pages, v_pages, kv_lens, page_table, k_scale, v_scale, sm_scale,
                                    prefetch, prefetch_experts, prefetch_max_blocks)
            assert not isinstance(out, tuple)
            return out
    return attn_ref_mod.decode_attention_ref(q, k_pages, v_pages, kv_lens, page_table, k_scale, v_scale,
                                             sm_scale=sm_scale)


def _attention_kernel(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, kv_lens: jax.Array,
                      page_table: jax.Array, k_scale: jax.Array, v_scale: jax.Array, sm_scale: float,
                      prefetch: tuple[jax.Array, ...], prefetch_experts: tuple[tuple[jax.Array, jax.Array], ...],
                      prefetch_max_blocks: int, partial_rows: int = 0) -> jax.Array | tuple[jax.Array, jax.Array]:
    from kestrel_jax.pallas import paged_attention_mgpu as kern

    mask = l2_prefetch_mask()
    return _jitted(kern.decode_attention_kernel, ("sm_scale", "prefetch_max_blocks", "prefetch_late",
                                                  "prefetch_expert_part", "partial_rows"))(
        q, k_pages, v_pages, kv_lens, page_table, k_scale, v_scale, sm_scale=sm_scale,
        prefetch=prefetch, prefetch_experts=prefetch_experts, prefetch_max_blocks=prefetch_max_blocks,
        prefetch_late=bool(mask & 4), prefetch_expert_part=2 if mask & 8 else 1, partial_rows=partial_rows)


def decode_attention_partials(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, kv_lens: jax.Array,
                              page_table: jax.Array, k_scale: jax.Array, v_scale: jax.Array, *, sm_scale: float,
                              prefetch: tuple[jax.Array, ...] = (),
                              prefetch_experts: tuple[tuple[jax.Array, jax.Array], ...] = (),
                              prefetch_max_blocks: int = 8) -> tuple[jax.Array, jax.Array] | None:
    """Decode attention's split-KV partials, unmerged: (o [8, H, S, 64] f32, lse [8, H, S] f32),
    rows past the batch's padding, for a later launch to merge (`moe_mgpu.MergedRows`), on the
    kernel path where the batch fits 8 rows and the attention splits (`planned_splits` > 1); None
    otherwise (the caller runs `decode_attention`). Prefetch arguments as `decode_attention`'s."""
    rows, heads, head_dim = q.shape
    if not _want_kernel() or rows > 8:
        return None
    from kestrel_jax.pallas import gemv_mgpu
    from kestrel_jax.pallas import paged_attention_mgpu as kern

    if not kern.decode_attention_kernel_supported(q, k_pages, page_table):
        return None
    splits = kern.planned_splits(rows, k_pages.shape[1], page_table.shape[1], k_pages.shape[2])
    if splits == 1 or not gemv_mgpu.merge_supported(
            jax.ShapeDtypeStruct((8, heads, splits, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((8, heads, splits), jnp.float32),
            jax.ShapeDtypeStruct((heads * head_dim, 64), jnp.bfloat16)):
        return None
    out = _attention_kernel(q, k_pages, v_pages, kv_lens, page_table, k_scale, v_scale, sm_scale, prefetch,
                            prefetch_experts, prefetch_max_blocks, partial_rows=8)
    assert isinstance(out, tuple)
    return out


def merge_in_up_wanted() -> bool:
    """Whether a decode MoE layer whose output projection rides in the down GEMM's launch
    (`proj_in_down_wanted`) also has the up GEMM's launch merge split-KV attention's partials into
    that projection's rows (`moe_mgpu.MergedRows`) instead of an XLA fusion of their own (the
    merge and the pad to 8 rows: 1.35 us per MoE layer at batch 1 on an H200). On by default since
    the forty-eighth session (H200: MD3 batch-1 step -19.4 us, -1.5%, 20 launches fewer, the up GEMM
    +8.3 us of it; W1 912.7 -> 931.1 tok/s; the forward differs from XLA's merge by last-bit
    roundings of the merged rows, max 0.56% of the largest hidden value, the logits' argmax equal).
    It applies where attention splits the KV range (batch 1-4 for MD3). KESTREL_JAX_MERGE_IN_UP=0
    (read at trace time) keeps XLA's fusion."""
    return flag("KESTREL_JAX_MERGE_IN_UP", True)


def merge_partials(parts: tuple[jax.Array, jax.Array], rows: int, dtype: Any) -> jax.Array:
    """[rows, H * 64] in dtype from `decode_attention_partials`' (o, lse): the merge
    `decode_attention` forms (`paged_attention_mgpu.merge_splits`), for a caller whose partials
    no kernel merged."""
    from kestrel_jax.pallas import paged_attention_mgpu as kern

    o, lse = parts
    return kern.merge_splits(o[:rows], lse[:rows], dtype).reshape(rows, -1)


def merged_rows(parts: tuple[jax.Array, jax.Array], rows: int) -> Any:
    """`decode_attention_partials`' (o, lse) of `rows` real rows as a side product's x that the up
    GEMM's launch merges (`moe_mgpu.MergedRows`; `moe_layer_rows`' side)."""
    from kestrel_jax.pallas import moe_mgpu

    return moe_mgpu.MergedRows(parts[0], parts[1], rows)


def merged_projection_wanted() -> bool:
    """Whether `decode_attention_projected` merges split-KV attention's partials inside the output
    projection's GEMM launch (`gemv_mgpu.gemv_merged`) instead of in an XLA fusion of their own
    (the merge and the pad to the GEMM's 8 rows: ~1.3 us per layer at batch 1 on an H100, twenty-
    second session). KESTREL_JAX_MERGED_PROJ=1 (read at trace time), opt-in until measured."""
    return flag("KESTREL_JAX_MERGED_PROJ", False)


def decode_attention_projected(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, kv_lens: jax.Array,
                               page_table: jax.Array, k_scale: jax.Array, v_scale: jax.Array, w: jax.Array,
                               b: jax.Array | None, *, sm_scale: float, max_rows: int,
                               prefetch: tuple[jax.Array, ...] = (),
                               prefetch_experts: tuple[tuple[jax.Array, jax.Array], ...] = (),
                               prefetch_max_blocks: int = 8) -> jax.Array | None:
    """Decode attention and its output projection ([B, H, D] queries -> [B, N] bf16), with the
    split-KV merge inside the projection GEMM's launch: on the kernel path with
    `merged_projection_wanted()`, B <= min(8, max_rows), attention split (`planned_splits` > 1)
    and shapes `gemv_mgpu.merge_supported` takes; None otherwise (the caller runs
    `decode_attention` and its projection). Prefetch arguments as `decode_attention`'s."""
    rows, heads, head_dim = q.shape
    if not (_want_kernel() and merged_projection_wanted()) or rows > min(max_rows, 8):
        return None
    from kestrel_jax.pallas import gemv_mgpu
    from kestrel_jax.pallas import paged_attention_mgpu as kern

    if not kern.decode_attention_kernel_supported(q, k_pages, page_table):
        return None
    splits = kern.planned_splits(rows, k_pages.shape[1], page_table.shape[1], k_pages.shape[2])
    w16 = w.astype(jnp.bfloat16)
    if splits == 1 or not gemv_mgpu.merge_supported(jax.ShapeDtypeStruct((8, heads, splits, head_dim), jnp.float32),
                                                    jax.ShapeDtypeStruct((8, heads, splits), jnp.float32), w16):
        return None
    out = _attention_kernel(q, k_pages, v_pages, kv_lens, page_table, k_scale, v_scale, sm_scale, prefetch,
                            prefetch_experts, prefetch_max_blocks, partial_rows=8)
    assert isinstance(out, tuple)
    return _jitted(gemv_mgpu.gemv_merged, ("rows",))(out[0], out[1], w16, b, rows=rows)


# Batches up to this many rows have decode attention prefetch the step's next weights into L2:
# measured at one row only (at 8 rows the selected experts' up weights could be 4-8x L2).
PREFETCH_MAX_ROWS = 1


def l2_prefetch_mask() -> int:
    """What decode attention asks into L2 for the GEMMs after it (`l2_prefetch`), read at trace
    time from KESTREL_JAX_L2_PREFETCH, a bit mask: 1 the output projection's weight, 2 the
    selected experts' up weights (MoE layers whose routing tables the QKV epilogue built); 4 asks
    once each CTA's own loads are consumed instead of at its start, 8 only the first half of each
    expert's rows, 16 the selected experts' down weights as well (measured slower: session 24,
    +31.8 us); 0 asks nothing. Default 14, the experts' first halves, late (H100, batch-1 MD3
    step, twenty-second session: CUPTI 1,664.0 -> 1,621.7 us, the MoE GEMMs -59 us, attention
    +12; W1 706.7 -> 719.9 tok/s). The projection's weight did not pay (its GEMM -0.15 us per
    layer, attention +1.3 us)."""
    return integer("KESTREL_JAX_L2_PREFETCH", 14, high=31)


def prefill_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, cu_q_lens: jax.Array,
                      kv_lens: jax.Array, page_table: jax.Array, prefix_lens: jax.Array, k_scale: jax.Array,
                      v_scale: jax.Array, *, sm_scale: float) -> jax.Array:
    if _want_kernel():
        from kestrel_jax.pallas import paged_attention_prefill_mgpu as kern

        if kern.prefill_attention_kernel_supported(q, k_pages, page_table):
            return _jitted(kern.prefill_attention_kernel, ("sm_scale",))(
                q, k_pages, v_pages, cu_q_lens, kv_lens, page_table, prefix_lens, k_scale, v_scale, sm_scale=sm_scale)
    return attn_ref_mod.prefill_attention_ref(q, k_pages, v_pages, cu_q_lens, kv_lens, page_table,
                                              prefix_lens, k_scale, v_scale, sm_scale=sm_scale)


# --------------------------------------------------------------------------------------------
# Decode-size projections


def _gemv_usable(x: jax.Array, max_rows: int, *ws: jax.Array, rows: int | None = None) -> bool:
    if not _want_kernel() or (rows or x.shape[0]) > max_rows:
        return False
    from kestrel_jax.pallas import gemv_mgpu as kern

    return all(kern.gemv_supported(x, w.astype(x.dtype)) for w in ws)


def gate(table: jax.Array, row: int, column: int) -> Gate:
    """A decode GEMM's gate (`gemv_mgpu.Gate`): 0 at table[row, column] skips its product."""
    from kestrel_jax.pallas import gemv_mgpu  # imported when used: the kernel module loads Mosaic GPU

    return gemv_mgpu.Gate(table, row, column)


def small_linear(x: jax.Array, w: jax.Array, b: jax.Array | None, *, max_rows: int,
                 rows: int | None = None, gate: Gate | None = None, splits: int | None = None,
                 stages: int = 4, row_major: bool = False) -> jax.Array | None:
    """`x @ w + b` through the decode GEMM kernel (`gemv_mgpu`) when the kernel path is on, x has
    at most `max_rows` rows and the kernel supports the shapes; None otherwise (the caller runs
    its own jnp product). `rows`: the real rows when x arrives padded (the result has `rows`).
    `gate`: where its element is 0 the kernel streams nothing and the result is just b (a product
    the step does not need; `region_gate`). `splits` (K ranges per column block; default: the
    kernel's `default_splits`) and `stages` (TMA ring slots) tune the kernel; `row_major` (x of
    64 rows) has it form y's partials instead of y^T's (`gemv_mgpu.gemv_partials`)."""
    if not _gemv_usable(x, max_rows, w, rows=rows):
        return None
    from kestrel_jax.pallas import gemv_mgpu as kern

    return _jitted(kern.gemv, ("rows", "splits", "stages", "row_major"))(
        x, w.astype(x.dtype), b, rows=rows, gate=gate, splits=splits, stages=stages, row_major=row_major)


def dense_decode_gemv() -> tuple[int, int, int]:
    """(splits of the joined QKV + fc1 product, splits of the joined output projection + fc2
    product, ring stages) for a dense layer's decode products through the decode GEMM kernel
    (`gemv_mgpu.gemv`) instead of XLA's GEMM: KESTREL_JAX_GEMV_DENSE_IN (the K ranges per 64-column
    block; default 0: XLA's GEMM) at up to 64 rows, KESTREL_JAX_GEMV_DENSE_OUT (default 4; 0: XLA's
    GEMM) in 64-row steps (one-row steps: `dense_out_splits`), and KESTREL_JAX_GEMV_DENSE_STAGES
    (default 8), read at trace time, on the kernel path.
    H200, forty-third session, MD2's 64-row decode step: XLA's output + fc2 product 14.0 us plus
    4.1 us of residual add over its 16 f32 partials; the kernel at 4 splits and 8 stages (row-major
    partials) 12.5 + 2.0: step -124.5 us of CUPTI time, MD2 W2 C=64 +1.3% in three alternating
    pairs (10,125 against 9,991 output tok/s). Forty-fourth session: one MD2 layer's output within
    bf16 rounding of XLA's (max 0.25% of the largest state, RMS 1.2e-4, as the kernel at 4 against 8
    splits), MD3 W2 C=64 +1.1% (one pair), so on by default. The QKV + fc1 product through it was
    slower (17.7 us at 2 splits against XLA's 18.2-19.3 us of GEMM but more around it); below 64
    rows the kernel's partials are y^T, and XLA then carried the residual stream transposed into
    the next LayerNorm (1.5 -> 5.1 us), so from 2 to 63 rows the output product stays on XLA (at
    one row y^T is y)."""
    return (integer("KESTREL_JAX_GEMV_DENSE_IN", 0, high=64), integer("KESTREL_JAX_GEMV_DENSE_OUT", 4, high=64),
            integer("KESTREL_JAX_GEMV_DENSE_STAGES", 8, low=1, high=16))


def proj_gemv_tuning() -> tuple[int | None, int]:
    """(K splits or None for the kernel's `default_splits`, ring stages) of the decode output
    projection's GEMM on the decode GEMM kernel (up to `proj_kernel_rows()` rows: MoE layers', and
    dense layers' where they project on their own, `dense_proj_kernel`):
    KESTREL_JAX_GEMV_PROJ_SPLITS (default 0: the kernel's choice, 8 for MD3's [2048, 2048] at 132
    SMs) and KESTREL_JAX_GEMV_PROJ_STAGES (default 4), read at trace time, for A/B runs: the
    projection streams 8.4 MB in 3.5 us at one row on an H200 (56% of copy, forty-fourth session),
    latency-bound."""
    splits = integer("KESTREL_JAX_GEMV_PROJ_SPLITS", 0, high=64)
    return (splits or None), integer("KESTREL_JAX_GEMV_PROJ_STAGES", 4, low=1, high=16)


def dense_out_splits(k: int, one_row: bool = False) -> int:
    """Splits of the decode GEMM kernel for a dense layer's joined output + fc2 product of K = `k`
    (0: XLA's GEMM): in 64-row decode steps KESTREL_JAX_GEMV_DENSE_OUT (`dense_decode_gemv`),
    with `one_row` KESTREL_JAX_GEMV_DENSE_OUT_ONE_ROW (default 4; 0: XLA's GEMM), read at trace
    time. A default gives way to XLA's GEMM where it does not divide the product's K steps of 64 (a
    checkpoint of other sizes than Moondream's); a value set in the environment stays as asked (the
    kernel refuses one that does not divide)."""
    name = "KESTREL_JAX_GEMV_DENSE_OUT_ONE_ROW" if one_row else "KESTREL_JAX_GEMV_DENSE_OUT"
    splits = integer(name, 4, high=64) if one_row else dense_decode_gemv()[1]
    if name in os.environ or not splits:
        return splits
    from kestrel_jax.pallas import gemv_mgpu as kern

    return splits if k % kern.BLOCK_K == 0 and (k // kern.BLOCK_K) % splits == 0 else 0


def dense_out_one_row() -> bool:
    """Whether a one-row decode step forms a dense layer's output projection and fc2 as the one
    joined product over `Block.dense_out_w` (fc1 on its own, which XLA merges with the QKV product)
    where the runner joined the weights: KESTREL_JAX_DENSE_OUT_ONE_ROW, default 1 (0: the projection
    on the decode GEMM kernel, 8.4 MB in 3.5-3.7 us, 56% of copy, fc2 on XLA's, and a residual add
    over both products' partials), read at trace time. The joined product runs on the decode GEMM
    kernel in `dense_out_splits(k, one_row=True)` K ranges. H200, forty-fourth session: MD2
    batch-1 decode step -141.7 us of CUPTI time (48 fewer launches; XLA's GEMM for the joined product
    -135.5, at 8 splits -136.1), MD3 -8.5 us (four dense layers), MD2 W1 846.9 -> 903.6 tok/s (one
    pair); outputs within bf16 rounding of the separate products (one rounding of their sum
    instead of two)."""
    return flag("KESTREL_JAX_DENSE_OUT_ONE_ROW", True)


def dense_in_one_row() -> bool:
    """Whether a one-row decode step forms a dense layer's QKV and fc1 as the one product over the
    weights joined at load time (`Block.dense_decode_in`), as steps of more rows do, instead of
    XLA's product over the two weights concatenated at run time: KESTREL_JAX_DENSE_IN_ONE_ROW, read
    at trace time; default on (=0 turns it off). The QKV epilogue reads the QKV columns, bias
    included, out of that product in place (`decode_qkv`'s wide read, on at one row, MD3's tau over
    the QKV columns; the thirty-fifth session's joined product at one row without it cost +22.8 us,
    its slices becoming copies). H200, forty-seventh session: MD2 batch-1 step 1,409.0 -> 1,365.9 us
    (-3.1%, 24 launches fewer: XLA's 1.5 us QKV bias add per layer), W1 913.1 -> 944.1 tok/s (one
    pair); MD3's four dense layers step -0.3% (4 launches fewer), and on an H100 (fifty-first
    session, one machine, W1 A B A B in processes of their own) MD3 W1 788.8 / 794.1 off against
    797.7 / 799.0 on (+0.9%), so on for MD3 too since then; the forwards and logits at batch 1
    unchanged either way (max difference 0.0)."""
    return flag("KESTREL_JAX_DENSE_IN_ONE_ROW", True)


def region_gate_wanted() -> bool:
    """Whether the steps gate the region heads' decode GEMMs on the host's "any row needs them"
    column (`batch.D_REGION` / `T_REGION`): a step of text rows only then skips their weight
    streams (MD3: four products, ~16 MB; MD2: its two decoder MLPs, ~117 MB, which then run on
    the decode GEMM kernel too). On by default (H100, session 24: batch-1 step -8.9 us; with the
    heads barrier MD3 W1 +1.4%, W2 C=64 +3.5%, MD2 W1 +3.5%); KESTREL_JAX_REGION_GATE=0 (read at
    trace time) turns it off."""
    return flag("KESTREL_JAX_REGION_GATE", True)


def heads_barrier_wanted() -> bool:
    """Whether the region heads' logits from the decode GEMM kernel pass an optimization barrier
    before their argmax (`region._materialised`). On by default on the kernel path (H100,
    session 24: batch-1 step -15.1 us, XLA's fused reduce of the logits 22.6 -> 9.2 us);
    KESTREL_JAX_HEADS_BARRIER=0 (read at trace time) turns it off. Never on the reference path
    (nothing there for it to keep apart)."""
    return _want_kernel() and flag("KESTREL_JAX_HEADS_BARRIER", True)


def pin_inputs(*arrays: jax.Array | None) -> tuple[jax.Array | None, ...]:
    """A step's per-call inputs read through one copy kernel (`pin_inputs.pin`): then only that
    kernel's graph node, not every layer's, is updated when the inputs move between calls. Opt-in
    on the kernel path (KESTREL_JAX_PIN_INPUTS=1, read at trace time); the arrays as they are
    otherwise. Measured (H200, MD2, thirty-first session): outputs bit-identical, the mixed step's
    update 136 us instead of 209, but the host time per launch and W2 unchanged (+0.1%), so off."""
    if not (_want_kernel() and flag("KESTREL_JAX_PIN_INPUTS", False)):
        return arrays
    from kestrel_jax.pallas.pin_inputs import pin

    return tuple(pin(arrays))


def small_linear_pair(x: jax.Array, w1: jax.Array, b1: jax.Array | None, w2: jax.Array, b2: jax.Array | None, *,
                      max_rows: int, rows: int | None = None, padded_ok: bool = False,
                      tau: Any = None, gate: Gate | None = None) -> tuple[jax.Array, jax.Array, Any] | None:
    """(`x @ w1 + b1`, `x @ w2 + b2`, tau dots or None) from one decode GEMM launch, under the same
    conditions as `small_linear`; None otherwise. With `padded_ok` (callers whose consumers are
    kernels that take padded rows) and `gemv_rows_wanted()`, the two products come back as finished
    rows padded to x's row tile (`gemv_mgpu.gemv_rows`: rows >= `rows` belong to padding rows of x)
    instead of being summed from split partials by XLA; then with `tau` (MD3's `TauWeights` over
    the first product's columns, bf16 [32, N1]) and `tau_dots_wanted()` the same launch also forms
    the tau dot products (`gemv_rows`' tau_w), the third item (`qkv_epilogue.TauDots`, for
    `decode_qkv`'s tau_dots). `gate` as `small_linear`'s (split partials only)."""
    if not _gemv_usable(x, max_rows, w1, w2, rows=rows):
        return None
    from kestrel_jax.pallas import gemv_mgpu as kern

    w1c, w2c = w1.astype(x.dtype), w2.astype(x.dtype)
    if padded_ok and gate is None and gemv_rows_wanted() and _rows_biases_ok(w1c, b1, w2c, b2):
        return _rows_kernel(x, w1c, b1, w2c, b2, tau)[:3]
    y1, y2 = _jitted(kern.gemv_pair, ("rows",))(x, w1c, b1, w2c, b2, rows=rows, gate=gate)
    return y1, y2, None


def ln_in_rows_mode() -> str:
    """Whether a one-row decode MoE layer normalises its input inside the QKV + router
    rows kernel (`decode_ln_qkv_router`) instead of in the LayerNorm kernel's launch before it:
    KESTREL_JAX_LN_IN_ROWS, read at trace time: 0 no; 1 (default) yes, each step of the kernel's K
    loop forming its x tile from the normalised row while it waits for its weight tile; `ahead` yes,
    every x tile formed before the first MMA. `ahead` was the forty-ninth session's build (H100,
    MD3 batch-1 step): the LayerNorm launch went (1.65 us x 20) but the rows kernel grew from 11.4
    to 13.9 us, step 1,499 -> 1,515-1,519 us (+1.1-1.3%); a deeper weight ring (16, 22 stages) did
    not hide it. 1 (fifty-second session, H100, call 2) moves the 32 tile stores into the loop:
    the rows kernel 11.39 -> 12.81 us against the 1.70 us launch it removes, MD3 batch-1 step
    1,507.5 -> 1,499.3 us (-0.5%, 20 launches fewer), W1 797.2 tok/s on (its off run was cut short
    by the session's device time; session 51's H100 runs of these defaults: 797.7 / 799.0), so still
    off. Then x, scale and bias were loaded before the weight ring's fill (they had queued behind
    it); fifty-third session (H100), with KESTREL_JAX_DENSE_LN_IN_ROWS on too: MD3 batch-1 step
    1,491.2 -> 1,475.1 us (-1.1%; this switch alone -0.95%, the rows kernel 11.48 -> 12.27 us), W1
    810.6 / 810.9 tok/s against 800.9 / 798.1 off (+1.4%, two pairs), so on. GPU kernel check:
    products bit for bit those of the rows kernel on the normalised rows. Forward on against off:
    identical at one row (the same normalised tiles reach the same MMAs)."""
    return choice("KESTREL_JAX_LN_IN_ROWS", "1", ("0", "1", "ahead"))


def ln_in_rows_wanted() -> bool:
    """`ln_in_rows_mode()` other than 0."""
    return ln_in_rows_mode() != "0"


def decode_ln_qkv_router(x: jax.Array, scale: jax.Array, bias: jax.Array, w1: jax.Array, b1: jax.Array | None,
                         w2: jax.Array, b2: jax.Array | None, experts: ExpertWeights, *, eps: float, max_rows: int,
                         tau: Any = None, residual: PendingResidual | None = None) -> tuple[Any, ...] | None:
    """A decode MoE layer's LayerNorm and its QKV + router products in one launch: `gemv_mgpu.gemv_rows`
    with `ln`, every CTA normalising x (the residual stream, [1, D]) itself while its weight
    ring fills. -> (QKV rows, router rows, tau dots or None, the normalised rows), each padded to
    the row tile of 8 as `small_linear_pair(padded_ok=True)` and `decode_moe_layer_norm` hand them
    over; None where either of those would not take this path (off the kernel path, the rows
    kernel or the LayerNorm kernel switched off, shapes they refuse), where the expert GEMMs want
    an f16 copy of the rows (W8A16), or with `ln_in_rows_wanted()` off. With `residual` (x is then
    its x) the same launch first adds the previous layer's output (`gemv_rows`' residual; an MoE
    layer's: `moe_residual_in_rows_wanted`), the new residual stream row a fifth item; None where
    the kernel refuses it."""
    if not (ln_in_rows_wanted() and gemv_rows_wanted() and flag("KESTREL_JAX_LN_KERNEL", True)):
        return None
    if residual is not None:
        x = residual.x
    if not _gemv_usable(x, max_rows, w1, w2):
        return None
    from kestrel_jax.pallas import gemv_mgpu as kern
    from kestrel_jax.pallas import moe_mgpu

    if kern.ln_rows_problem(x, scale, bias) is not None:  # (one row)
        return None
    if moe_mgpu.moe_kernel_supported(x, experts, 1) and moe_mgpu.f16_rows_wanted(x.shape[0], experts):
        return None
    w1c, w2c = w1.astype(x.dtype), w2.astype(x.dtype)
    if not _rows_biases_ok(w1c, b1, w2c, b2):
        return None
    kw: dict[str, Any] = {}
    if residual is not None:
        res = residual.kernel_args()
        if kern.residual_problem(x, *res) is not None:
            return None
        kw["residual"] = res
    return _rows_kernel(x, w1c, b1, w2c, b2, tau, stages=rows_gemv_stages(ln=True, moe=True), ln=(scale, bias),
                        ln_eps=float(eps), ln_tiles_ahead=ln_in_rows_mode() == "ahead", **kw)


def dense_ln_in_rows_wanted() -> bool:
    """Whether a one-row decode step normalises a dense layer's input inside the rows kernel of its
    joined QKV + fc1 product (`decode_ln_dense_in`) instead of in the one-row LayerNorm launch before
    XLA's GEMM: KESTREL_JAX_DENSE_LN_IN_ROWS, read at trace time (default 1; 0 turns it off; the
    tiles formed as `ln_in_rows_mode` says, in the loop unless it is `ahead`). H100, fifty-second
    session, MD2 batch-1 step: 1,716.2 -> 1,712.1 us (-0.2%, 24 launches fewer; the rows kernel
    with the LayerNorm 23.60 us per layer against XLA's GEMM 22.03 + the LayerNorm launch 1.63).
    Fifty-third session (H100), with the LayerNorm's loads before the weight ring's fill: MD2 step
    1,717.8 -> 1,705.1 us (-0.7%; 23.13 us per layer against 22.65 + 1.66), W1 769.4 against 768.2
    tok/s (one pair, +0.2%); MD3, with KESTREL_JAX_LN_IN_ROWS on, a further -0.1% on the step and
    part of its +1.4% W1, so on. GPU kernel check:
    the products bit for bit the rows kernel's on the normalised rows. Forward on against off: the
    same normalised row, the product from another GEMM (the rows kernel's f32 sums in its own order
    against XLA's)."""
    return flag("KESTREL_JAX_DENSE_LN_IN_ROWS", True)


def decode_ln_dense_in(x: jax.Array, scale: jax.Array, bias: jax.Array, w: jax.Array, b: jax.Array | None, *,
                       eps: float, residual: PendingResidual | None = None) -> tuple[jax.Array, ...] | None:
    """A dense layer's one-row decode LayerNorm and its joined QKV + fc1 product (`Block.dense_w`,
    `dense_b`) in one launch: `gemv_mgpu.gemv_rows` with `ln`, every CTA normalising x (the residual
    stream, [1, D]) itself. -> (the product's rows, the normalised rows), both padded to the row tile
    of 8 (the QKV epilogue reads the QKV columns of row 0 in place); None off the kernel path, with
    `dense_ln_in_rows_wanted()` or the rows kernel off, or for shapes the kernel refuses. With
    `residual` (the previous layer's output still to be added, `dense_out_row0`), x is ignored: the
    same launch forms the residual stream's new row from `residual` (`gemv_rows`' residual), and
    it is the third item."""
    if not (dense_ln_in_rows_wanted() and gemv_rows_wanted()):
        return None
    if residual is not None:
        x = residual.x
    if x.shape[0] != 1 or not _gemv_usable(x, 1, w):
        return None
    from kestrel_jax.pallas import gemv_mgpu as kern

    wc = w.astype(x.dtype)
    if kern.ln_rows_problem(x, scale, bias) is not None or not _rows_biases_ok(wc, b, wc, None):
        return None
    res = None if residual is None else residual.kernel_args()
    if res is not None and kern.residual_problem(x, *res) is not None:
        return None
    run = _jitted(kern.gemv_rows, ROWS_STATIC)
    return tuple(run(x, wc, b, stages=rows_gemv_stages(ln=True), ln=(scale, bias), ln_eps=float(eps),
                     ln_tiles_ahead=ln_in_rows_mode() == "ahead", **({} if res is None else {"residual": res})))


class PendingResidual(NamedTuple):
    """A one-row residual add not yet done: the stream x [1, D] bf16 plus the previous layer's
    output, held as its product's row-0 split partials [S, D] f32 (`dense_out_row0`, or an MoE
    layer's output projection streamed by its down GEMM) and bias (bf16 [D] or None), and for an
    MoE layer its unreduced expert rows (`ExpertRows`' y, dest, weights, n_valid); the next layer's
    rows kernel adds it (`decode_ln_dense_in`, `decode_ln_qkv_router`), or `add_residual` in XLA."""

    x: jax.Array
    parts: jax.Array
    bias: jax.Array | None
    expert: tuple[jax.Array, jax.Array, jax.Array, jax.Array] | None = None

    def kernel_args(self) -> tuple[Any, ...]:
        """`gemv_mgpu.gemv_rows`' residual."""
        return (self.parts, self.bias) + (() if self.expert is None else (self.expert,))


def add_residual(r: PendingResidual) -> jax.Array:
    """x + the finished product (+ the expert rows' weighted sum), as XLA rounds the model's adds
    (`gemv_mgpu.residual_row_ref`)."""
    from kestrel_jax.pallas import gemv_mgpu as kern

    return kern.residual_row_ref(r.x, *r.kernel_args())


def moe_residual_in_rows_wanted() -> bool:
    """Whether a one-row decode step leaves an MoE layer's residual add (x + the output projection
    streamed by its down GEMM + the weighted sum of its expert rows) to the next MoE layer's QKV +
    router rows kernel (`decode_ln_qkv_router`'s residual), as `dense_residual_in_rows_wanted` does
    for dense layers: the down GEMM writes the projection's row-0 split partials
    (`moe_mgpu.SideProduct.row0`) and the rows kernel also gathers the token's 8 expert rows.
    KESTREL_JAX_MOE_RESIDUAL_IN_ROWS, read at trace time: default 1 (0 turns it off). It needs the
    LayerNorm in the rows kernel (`ln_in_rows_wanted`) and the projection in the down GEMM
    (`proj_in_down_wanted`). Built in the fifty-fourth session; H100, fifty-sixth session: MD3's
    hidden states after one decode step, on against off, the same bit for bit
    (`tools/check_decode_fusion.py`); MD3 batch-1 step 1,482.3 -> 1,471.6 us of CUPTI time (-0.7%,
    19 launches fewer: the 1.88 us add per MoE-to-MoE layer; the QKV + router rows kernel 14.44 ->
    15.64 us); MD3 W1 with it and the rows kernel's early bias load 815.1 / 811.5 tok/s against
    804.0 / 791.1 / 798.7 without either (+1.9%)."""
    return flag("KESTREL_JAX_MOE_RESIDUAL_IN_ROWS", True)


def dense_residual_in_rows_wanted() -> bool:
    """Whether a one-row decode step leaves a dense layer's residual add to the next dense layer's
    rows kernel (`decode_ln_dense_in`'s residual): the joined output + fc2 product then writes its
    row-0 split partials ([S, D] f32, `dense_out_row0`) and the next rows kernel, which normalises
    the stream anyway, first forms x + the finished product itself; XLA's residual add fusion (a
    launch per layer) goes. KESTREL_JAX_DENSE_RESIDUAL_IN_ROWS, read at trace time (default 1; 0
    turns it off); it needs the LayerNorm in the rows kernel (`dense_ln_in_rows_wanted`). H100,
    fifty-fourth session: MD2 batch-1 step 1,720.0 -> 1,691.3 us of CUPTI time (-1.7%, 23 launches
    fewer: the 1.58 us add per layer; the rows kernel 23.69 -> 24.02 us per layer), W1 762.9 /
    762.7 off against 774.6 / 775.2 tok/s on (+1.6%, two pairs in processes of their own); MD3 (three
    dense-to-dense layers) W1 797.2 off against 799.9 on (one pair). GPU checks: the new row exactly
    the numpy reference rounding each operation, the row-0 partials bit for bit the padded
    partials' column 0, the normalised row and products bit for bit the rows kernel's fed the row
    (`tools/check_ln_in_rows.py --dense --residual`, 4 draws); MD2's hidden states after one decode
    step, on against off, the same bit for bit (`tools/check_decode_fusion.py`, 24 layers and 2)."""
    return flag("KESTREL_JAX_DENSE_RESIDUAL_IN_ROWS", True)


def dense_out_row0(g: jax.Array, w: jax.Array, b: jax.Array | None) -> tuple[jax.Array, jax.Array | None] | None:
    """A dense layer's one-row joined output + fc2 product (g [1, K] @ w), unfinished: (its row-0
    split partials [S, N] f32 from the decode GEMM kernel in `dense_out_splits(one_row=True)` K
    ranges, the bias as bf16), for the next dense layer's rows kernel to add
    (`dense_residual_in_rows_wanted`); None where that does not apply (the switch or the kernels
    off, or shapes the kernels refuse)."""
    if not (dense_residual_in_rows_wanted() and dense_ln_in_rows_wanted() and gemv_rows_wanted()):
        return None
    if g.shape[0] != 1 or not _gemv_usable(g, 1, w):
        return None
    from kestrel_jax.pallas import gemv_mgpu as kern

    splits = dense_out_splits(g.shape[1], one_row=True)
    n = w.shape[1]
    if not splits or (g.shape[1] // kern.BLOCK_K) % splits or (b is not None and b.shape != (n,)):
        return None
    if kern.residual_problem(jax.ShapeDtypeStruct((1, n), g.dtype), jax.ShapeDtypeStruct((splits, n), jnp.float32),
                             None) is not None:
        return None
    parts = _jitted(kern.gemv_partials, ("splits", "stages", "row0"))(
        g, w.astype(g.dtype), splits=splits, stages=dense_decode_gemv()[2], row0=True)
    return parts, None if b is None else b.astype(g.dtype)


def _rows_biases_ok(w1: jax.Array, b1: jax.Array | None, w2: jax.Array, b2: jax.Array | None) -> bool:
    """Whether `gemv_mgpu.gemv_rows` takes these biases (none, or bf16 over each product's columns)."""
    return all(b is None or (b.shape == (w.shape[1],) and jnp.dtype(b.dtype) == jnp.dtype(jnp.bfloat16))
               for b, w in ((b1, w1), (b2, w2)))


# `gemv_mgpu.gemv_rows`' static keywords as the decode paths call it
ROWS_STATIC = ("stages", "ln_eps", "ln_tiles_ahead")


def _rows_kernel(x: jax.Array, w1: jax.Array, b1: jax.Array | None, w2: jax.Array, b2: jax.Array | None, tau: Any,
                 stages: int | None = None, **ln: Any) -> tuple[Any, ...]:
    """`gemv_mgpu.gemv_rows` over the pair (with MD3's tau dots where `tau` and `tau_dots_wanted()`
    allow, its ring `stages` (default `rows_gemv_stages`) and `ln`'s keywords if given) -> (rows 1,
    rows 2, `TauDots` or None, *appended outputs)."""
    from kestrel_jax.pallas import gemv_mgpu as kern

    run = _jitted(kern.gemv_rows, ROWS_STATIC)
    stages = stages or rows_gemv_stages("ln" in ln)
    if tau is not None and tau_dots_wanted() and kern.tau_dots_problem(tau.wq, tau.wv, w1.shape[1]) is None:
        from kestrel_jax.pallas.qkv_epilogue import TauDots

        y1, y2, dots, *rest = run(x, w1, b1, w2, b2, tau_w=(tau.wq, tau.wv), stages=stages, **ln)
        return (y1, y2, TauDots(dots, tau.alpha), *rest)
    y1, y2, *rest = run(x, w1, b1, w2, b2, stages=stages, **ln)
    return (y1, y2, None, *rest)


def rows_gemv_stages(ln: bool = False, moe: bool = False) -> int:
    """Ring stages of `gemv_mgpu.gemv_rows` (an MoE layer's decode QKV + router product; with `ln`,
    the one-row kernels that normalise their input, MoE and dense): KESTREL_JAX_GEMV_ROWS_STAGES,
    default the kernel's ROWS_STAGES (8; with `ln` ROWS_STAGES_LN, 5), read at trace time, for A/B
    runs (it sets both). At one row it streams ~25 MB in 9.2 us on an H200 (68% of copy, forty-fourth
    session), one CTA per 64 of its 6,208 columns (97 CTAs on 132 SMs); on the H100 8 stages beat 16
    and 24 (seventeenth session). With the LayerNorm inside, 6 beat 8 for MD2's joined dense product
    and tied for MD3 (fifty-sixth session, H100: MD2 W1 +2.5% with the early bias load); 5 beat 6
    (fifty-eighth session, H100: MD2's kernel -0.4 us, MD2 W1 +0.5%, MD3 W1 +0.3%). With `ln` and
    `moe` (an MoE layer's QKV + router kernel: 97 CTAs, one per SM, where a dense layer's has 224):
    KESTREL_JAX_GEMV_ROWS_STAGES_MOE, default the kernel's ROWS_STAGES_MOE_LN (8), or else
    KESTREL_JAX_GEMV_ROWS_STAGES where only that is set."""
    from kestrel_jax.pallas import gemv_mgpu as kern

    both = integer("KESTREL_JAX_GEMV_ROWS_STAGES", kern.ROWS_STAGES_LN if ln else kern.ROWS_STAGES, low=1, high=32)
    if not (ln and moe):
        return both
    return integer("KESTREL_JAX_GEMV_ROWS_STAGES_MOE", both if "KESTREL_JAX_GEMV_ROWS_STAGES" in os.environ
                   else kern.ROWS_STAGES_MOE_LN, low=1, high=32)


def tau_dots_wanted() -> bool:
    """Whether `small_linear_pair` forms MD3's tau dots in its launch where it can:
    KESTREL_JAX_TAU_DOTS, default 1; 0 has the QKV epilogue form them from the whole row itself
    (an A/B switch, read at trace time)."""
    return flag("KESTREL_JAX_TAU_DOTS", True)


def gemv_rows_wanted() -> bool:
    """Whether an MoE layer's decode QKV and router products come from `gemv_mgpu.gemv_rows`
    (finished bf16 rows read by the QKV epilogue and routing-table kernels as they are) rather than
    `gemv_pair` (split partials that XLA sums in two launches of its own before those kernels).
    KESTREL_JAX_GEMV_ROWS=0 (read at trace time) keeps `gemv_pair` for A/B runs."""
    return flag("KESTREL_JAX_GEMV_ROWS", True)


def split_dense_prefill_gemms() -> bool:
    """Whether a dense layer's MLP input in prefill and mixed steps passes an optimization barrier,
    so that XLA's dot merger cannot fuse the QKV and fc1 products (they read the same LayerNorm
    output) into one GEMM. On the H100 that merger concatenated the two weights ([2048, 6144] and
    [2048, 8192] bf16, 58 MB) into a new array in every dense layer of every prefill step: 42 us
    per layer, whatever the token count (eleventh session). Kept apart, the 2048-token MD3 prefill
    step measured 265 us faster (-1.8%, 4 dense layers) and W2 at 64 clients gained 1.9% (MD3,
    A/B/A) and 2.9% (MD2, 24 dense layers) together with the polynomial tau GELU (twelfth
    session). On by default on the kernel path; KESTREL_JAX_SPLIT_DENSE_GEMMS=0 turns it off (an
    A/B switch, read at trace time)."""
    return _want_kernel() and flag("KESTREL_JAX_SPLIT_DENSE_GEMMS", True)


# --------------------------------------------------------------------------------------------
# MoE


def route(x: jax.Array, router_w: jax.Array, router_b: jax.Array, top_k: int) -> Routing:
    return moe_ref_mod.route_ref(x, router_w, router_b, top_k)


def moe_layer_rows(x: jax.Array, router_w: jax.Array, router_b: jax.Array, experts: ExpertWeights, *,
                   top_k: int, num_valid_tokens: jax.Array | int | None = None, logits: jax.Array | None = None,
                   tokens: int | None = None, x_f16: jax.Array | None = None, route: Any = None,
                   side: tuple[Any, jax.Array] | None = None, side_row0: bool = False) -> ExpertRows | None:
    """The MoE layer's expert rows before the weighted sum (`moe_mgpu.moe_layer_rows`; x may be
    padded to the block width with `tokens` real rows) on the kernel path; None otherwise. `side`
    (x, w): a product the down GEMM may stream in its launch (`moe_mgpu.SideProduct`; its partials
    in the result's `side`, else that stays None; with `side_row0` x has one real row and the
    partials are row 0's, [splits, N]); x may be `moe_mgpu.MergedRows`, attention partials the up
    GEMM's launch merges for it."""
    if not _want_kernel():
        return None
    from kestrel_jax.pallas import moe_mgpu as kern

    t = x.shape[0] if tokens is None else tokens
    if not kern.moe_kernel_supported(x[:t], experts, top_k):
        return None
    return _jitted(kern.moe_layer_rows, ("top_k", "tokens", "side_row0"))(
        x, router_w, router_b, experts, top_k=top_k, num_valid_tokens=num_valid_tokens, logits=logits, tokens=tokens,
        x_f16=x_f16, route=route, side=side, **({"side_row0": True} if side_row0 else {}))


def proj_in_down_wanted() -> bool:
    """At decode steps of up to 8 rows an MoE layer's attention output projection is streamed by
    the down GEMM's launch (`moe_mgpu.SideProduct`: its pieces on the CTAs from the last one down,
    beside the expert units) instead of a decode GEMM launch of its own. H200, forty-sixth
    session, MD3's batch-1 step: 1,332.6 -> 1,281.1 us (-3.9%, 20 launches fewer; the down GEMM
    +1.7 us per layer for the projection's 8.4 MB, the projection's own 3.9-4.8 us launch gone),
    MD3 W1 869.9 / 870.1 -> 910.6 / 910.9 tok/s (+4.7%, two pairs). On by default;
    KESTREL_JAX_PROJ_IN_DOWN=0 (read at trace time) restores the projection's own launch."""
    return _want_kernel() and flag("KESTREL_JAX_PROJ_IN_DOWN", True)


def side_product_result(parts: jax.Array, rows: int, bias: jax.Array | None, dtype: Any) -> jax.Array:
    """[rows, N] in dtype from a side product's [splits, N, Mp] f32 partials: their sum rounded to
    dtype, then the bias added in dtype (`gemv_mgpu.gemv`'s rounding; XLA fuses it into the consumer)."""
    from kestrel_jax.pallas import gemv_mgpu as kern

    return kern._finish(kern._summed(parts, rows), bias, dtype)


def decode_moe_layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, experts: ExpertWeights, *, eps: float,
                          pad_rows: int) -> tuple[jax.Array, jax.Array | None] | None:
    """A decode MoE layer's LayerNorm in one launch (`layer_norm_triton`), padded to `pad_rows`
    rows, with the f16 copy the expert GEMMs read where they run W8A16: (rows, f16 rows or None);
    None off the kernel path, for shapes the kernel does not take, or with KESTREL_JAX_LN_KERNEL=0
    (read at trace time: XLA's statistics and normalisation launches). (Session 21, H100: also
    writing the rows quantised for the W8A8 up GEMM, which then skipped its own quantisation, was
    no faster at batch 1: the kernel +0.33 us, the GEMMs -0.37 us per MoE layer; removed.)"""
    if not _want_kernel() or not flag("KESTREL_JAX_LN_KERNEL", True):
        return None
    from kestrel_jax.pallas import layer_norm_triton as kern
    from kestrel_jax.pallas import moe_mgpu

    if kern.layer_norm_rows_problem(x, scale, bias, pad_rows) is not None:
        return None
    f16 = moe_mgpu.moe_kernel_supported(x, experts, 1) and moe_mgpu.f16_rows_wanted(x.shape[0], experts)
    return kern.layer_norm_rows_kernel(x, scale, bias, eps=eps, pad_rows=pad_rows, f16_copy=f16)


def decode_dense_layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, *, eps: float) -> jax.Array | None:
    """A dense layer's LayerNorm in a one-row decode step as one launch (`layer_norm_triton`, as
    MoE layers' `decode_moe_layer_norm`, unpadded) instead of XLA's two (H200, forty-fourth session,
    MD2's batch-1 step: statistics 1.29 us, normalisation 1.47-1.51 us per layer; the kernel took
    1.61 us at one row in MD3's MoE layers). H200, forty-sixth session: MD2's batch-1 step
    1,438.1 -> 1,409.3 us (-2.0%, 24 launches fewer; the kernel 1.75 us per layer), MD2 W1 906.1 ->
    916.7 / 917.5 tok/s (+1.2%); MD3's (4 dense layers) -0.8 us. Also the final LayerNorm
    (`post_ln`) of a one-row step's LM head (`TextModel.model_logits`). On by default;
    KESTREL_JAX_DENSE_LN_ONE_ROW=0 (read at trace time) restores XLA's launches. (The forty-third
    session's dense LayerNorm in 64-row steps, through another kernel, cut that step by 3.6 us but
    lowered MD2 W2 by 0.75%: not kept.) None off the kernel path, with the switch off, or for
    shapes the kernel does not take."""
    if not _want_kernel() or not flag("KESTREL_JAX_DENSE_LN_ONE_ROW", True):
        return None
    from kestrel_jax.pallas import layer_norm_triton as kern

    if x.shape[0] != 1 or kern.layer_norm_rows_problem(x, scale, bias, 1) is not None:
        return None
    return kern.layer_norm_rows_kernel(x, scale, bias, eps=eps, pad_rows=1)[0]


def residual_layer_norm(x: jax.Array, adds: tuple[jax.Array, ...], scale: jax.Array, bias: jax.Array, *,
                        eps: float) -> tuple[jax.Array, jax.Array]:
    """A block's residual adds and the next LayerNorm over prefill-sized rows: x [..., D] and 0-2
    addends like it -> (x' = ((x + a) + m), each add rounded to x's dtype, LN(x')), as the
    model's expressions compute them. On a GPU one launch (`layer_norm_blocks`) where XLA runs
    two (statistics, then normalisation); KESTREL_JAX_BLOCK_LN=0 (read at trace time) keeps XLA's.
    With no addends x' is x."""
    from kestrel_jax.pallas import layer_norm_blocks as kern

    if _want_kernel() and flag("KESTREL_JAX_BLOCK_LN", True):
        D = x.shape[-1]
        x2 = x.reshape(-1, D)
        adds2 = tuple(a.reshape(-1, D) for a in adds)
        rows = integer("KESTREL_JAX_BLOCK_LN_ROWS", kern.default_block_rows(D), low=1, high=64)
        warps = integer("KESTREL_JAX_BLOCK_LN_WARPS", kern.NUM_WARPS, low=1, high=32)
        problem = kern.residual_layer_norm_blocks_problem(x2, adds2, scale, bias, rows)
        if problem is None:
            xo, n = _jitted(kern.residual_layer_norm_blocks_kernel, ("eps", "block_rows", "num_warps"))(
                x2, adds2, scale, bias, eps=eps, block_rows=rows, num_warps=warps)
            return (x if not adds else xo.reshape(x.shape)), n.reshape(x.shape)
        if "KESTREL_JAX_BLOCK_LN_ROWS" in os.environ and "block" in problem:  # an A/B run would time XLA unawares
            raise ValueError(f"KESTREL_JAX_BLOCK_LN_ROWS={rows} does not fit [{x2.shape[0]}, {D}]: {problem}")
    return kern.residual_layer_norm_blocks_ref(x, adds, scale, bias, eps=eps)


LINEAR_GELU_MIN_ROWS = 256  # one CTA tile of `dense_mgpu.linear_gelu` (below: XLA)


def linear_gelu(x: jax.Array, fc1: Linear) -> jax.Array:
    """GELU_tanh(fc1(x)) over prefill-sized rows (MD2's dense MLP fc1): on a GPU the product with
    the GELU in its epilogue (`dense_mgpu.linear_gelu`, one launch and no [T, 8192] round trip),
    where XLA runs a GEMM and an elementwise pass. Elsewhere (and for shapes the kernel refuses, or
    fewer than 256 rows, or KESTREL_JAX_LINEAR_GELU=0, read at trace time) the layer itself, then
    `gelu_tanh`. KESTREL_JAX_LINEAR_GELU_BN / _STAGES pick the kernel's column tile
    and ring depth for A/B runs (a refused pair is an error, not a silent XLA run). H200: MD2
    prefill step -2.5%, mixed step -0.5%, W2 unchanged (dense_mgpu's docstring has the figures)."""
    from kestrel_jax.pallas import dense_mgpu as kern

    w, b = fc1.kernel[...], None if fc1.bias is None else fc1.bias[...]
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    if _want_kernel() and flag("KESTREL_JAX_LINEAR_GELU", True) and x2.shape[0] >= LINEAR_GELU_MIN_ROWS:
        bn = integer("KESTREL_JAX_LINEAR_GELU_BN", kern.DEFAULT_BLOCK_N, low=1)
        stages = integer("KESTREL_JAX_LINEAR_GELU_STAGES", kern.DEFAULT_STAGES, low=1)
        why = kern.problem(x2, w, b, block_n=bn, stages=stages)
        if why is None:
            y = _jitted(kern.linear_gelu, ("block_n", "stages"))(x2, w, b, block_n=bn, stages=stages)
            return y.reshape(*lead, w.shape[1])
        tuned = "KESTREL_JAX_LINEAR_GELU_BN" in os.environ or "KESTREL_JAX_LINEAR_GELU_STAGES" in os.environ
        if tuned and ("block_n" in why or "stages" in why):
            raise ValueError(f"KESTREL_JAX_LINEAR_GELU_BN={bn} / _STAGES={stages}: {why}")
    return gelu_tanh(fc1(x))


def residual_layer_norm_wanted() -> bool:
    """Whether a decode MoE layer followed by another forms its residual in the next layer's
    LayerNorm launch (`decode_residual_layer_norm`): KESTREL_JAX_RESIDUAL_LN=1, read at trace time.
    Off by default: measured no faster (H100, twentieth session, batch-1 decode step): the launch
    takes 3.5-3.7 us against 1.7 (LayerNorm kernel) + 1.8-2.2 (XLA's residual fusion), and the
    output projection's split-K partials then need a summing launch of their own (1.5 us; XLA had
    fused that sum into the residual): step 1,688.9 -> 1,715.3 us, W1 686.9 / 682.9 vs 672.3 /
    686.8 tok/s. Finished unsplit projection rows (`gemv_mgpu.gemv_rows`) instead cost 7.5 us
    against 4.6 (32 CTAs for 2,048 columns)."""
    return flag("KESTREL_JAX_RESIDUAL_LN", False)


def decode_residual_layer_norm(x: jax.Array, a: jax.Array, moe: Any, scale: jax.Array, bias: jax.Array,
                               experts: ExpertWeights, *, eps: float, pad_rows: int
                               ) -> tuple[jax.Array, jax.Array, jax.Array | None] | None:
    """The end of a decode MoE layer and the next MoE layer's LayerNorm in one launch
    (`layer_norm_triton.residual_layer_norm_rows_kernel`): x' = (x + a) + the weighted sum of the
    expert rows `moe` (`ExpertRows`), LN(x') with the next layer's `scale` / `bias` padded to
    `pad_rows` rows, and the f16 copy the next layer's `experts` read where they run W8A16:
    (x', rows, f16 rows or None). None where `decode_moe_layer_norm` would be None, with
    KESTREL_JAX_RESIDUAL_LN=0, or for shapes the kernel does not take."""
    if not _want_kernel() or not flag("KESTREL_JAX_LN_KERNEL", True) or not residual_layer_norm_wanted():
        return None
    from kestrel_jax.pallas import layer_norm_triton as kern
    from kestrel_jax.pallas import moe_mgpu

    if kern.residual_layer_norm_rows_problem(x, a, moe, scale, bias, pad_rows) is not None:
        return None
    f16 = moe_mgpu.moe_kernel_supported(x, experts, 1) and moe_mgpu.f16_rows_wanted(x.shape[0], experts)
    return kern.residual_layer_norm_rows_kernel(x, a, moe, scale, bias, eps=eps, pad_rows=pad_rows, f16_copy=f16)


def moe_layer(x: jax.Array, router_w: jax.Array, router_b: jax.Array, experts: ExpertWeights, *,
              top_k: int, num_valid_tokens: jax.Array | int | None = None,
              logits: jax.Array | None = None) -> jax.Array:
    """Rows at or past `num_valid_tokens` are padding: they select no expert (output 0).
    `logits`: the router product `x @ router_w + router_b` in x.dtype when the caller already has it
    (the kernel path may use it instead of computing it; the reference recomputes)."""
    if _want_kernel():
        from kestrel_jax.pallas import moe_mgpu as kern

        if kern.moe_kernel_supported(x, experts, top_k):
            return _jitted(kern.moe_layer, ("top_k",))(x, router_w, router_b, experts, top_k=top_k,
                                                       num_valid_tokens=num_valid_tokens, logits=logits)
    return moe_ref_mod.moe_layer_ref(x, router_w, router_b, experts, top_k=top_k,
                                     num_valid_tokens=num_valid_tokens)


# --------------------------------------------------------------------------------------------
# Decode QKV epilogue (tau, rotary, KV write)


def tau_gelu() -> Callable[[jax.Array], jax.Array]:
    """The GELU of MD3's tau pass where the decode epilogue kernel does not run (prefill, decode
    batches above its rows). On the kernel path: the kernels' polynomial erf in float32
    (`moe.gelu_erf_poly`, 1.5e-7, rounded to u's dtype); XLA's exact-erf pass took 39.7 us per
    layer at a 2048-token prefill on the H100 (eleventh session), and the polynomial made the
    whole step 338 us faster (-2.3%, twelfth session). KESTREL_JAX_TAU_GELU=exact (read at trace
    time) keeps XLA's erf there, as the reference path always does (`gelu_erf`)."""
    if _want_kernel() and choice("KESTREL_JAX_TAU_GELU", "poly", ("poly", "exact")) != "exact":
        return _gelu_poly
    return gelu_erf


def _gelu_poly(u: jax.Array) -> jax.Array:
    return moe_ref_mod.gelu_erf_poly(u.astype(jnp.float32)).astype(u.dtype)


def decode_qkv(u: jax.Array, positions: jax.Array, slots: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
               k_scale: jax.Array, v_scale: jax.Array, tau: Any, *, n_heads: int, rotary_dim: int,
               theta: float, tau_dots: Any = None,
               wide: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array] | None:
    """(q, k_pages, v_pages) from the fused QKV rows of a decode step in one kernel launch (tau,
    rotary and the KV write: `qkv_epilogue.decode_qkv_kernel`) when the kernel path is on and
    supports the shapes; None otherwise (the caller runs `qkv_heads_ref` and `write_kv`). With tau
    past `MAX_TAU_ROWS` rows the kernel forms no tau itself (every program would compute GELU over
    its whole row): XLA forms the factors (`qkv_epilogue.tau_factors`, the reference's
    expressions) and the kernel does rotary, scaling and the KV write. H100, twelfth session: the
    MD3 decode step 95 us faster at 16 rows (-1.8%, 48 fewer launches), 36 us at 64 rows (-0.3%,
    within the probe's spread); W2 at 64 clients A/B/A/B 6,432 / 6,682 / 6,467 / 6,437 tok/s.
    KESTREL_JAX_TAU_FACTORS=0 (read at trace time) keeps the XLA path there. `tau_dots`
    (`small_linear_pair`'s third item): the kernel forms tau from the dots the QKV GEMM formed, where it
    takes them (else from `tau`), at any row count. `wide`: the product u was sliced from (its
    first columns; a dense layer's joined QKV + fc1 product, `Block.dense_decode_in`), which the
    kernel reads in place of the slice (tau over its first columns) with KESTREL_JAX_DECODE_QKV_WIDE, read at trace
    time: default on at one row (with `dense_in_one_row`: MD2's batch-1 step -3.1%, the forty-seventh
    session) and off at more rows (opt-in there: it saves XLA's copy of the slice, MD2 64-row step
    -37 to -43 us, W2 unchanged within its runs' spread, the thirty-sixth session)."""
    if wide is not None and flag("KESTREL_JAX_DECODE_QKV_WIDE", u.shape[0] == 1):
        out = _decode_qkv(wide, positions, slots, k_pages, v_pages, k_scale, v_scale, tau, n_heads=n_heads,
                          rotary_dim=rotary_dim, theta=theta, route=None, tau_dots=tau_dots, u_cols=u.shape[1])
        if out is not None:
            return out[:3]
    out = _decode_qkv(u, positions, slots, k_pages, v_pages, k_scale, v_scale, tau, n_heads=n_heads,
                      rotary_dim=rotary_dim, theta=theta, route=None, tau_dots=tau_dots)
    return None if out is None else out[:3]


def prefill_qkv(u: jax.Array, positions: jax.Array, slots: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                k_scale: jax.Array, v_scale: jax.Array, tau: Any, *, n_heads: int, rotary_dim: int, theta: float,
                split: int = 0) -> tuple[jax.Array, ...] | None:
    """A prefill or mixed step's q and KV write in one launch (`qkv_epilogue.prefill_qkv_kernel`:
    rotary, tau scaling, the K/V rows into the pool) when the kernel path is on and supports the
    shapes; None otherwise (the caller runs `qkv_heads_ref` and `write_kv`). MD3's tau factors
    come from XLA (`qkv_epilogue.tau_factors` with `tau_gelu()`, as the jnp path forms them).
    -> (q, k_pages, v_pages), or with 0 < split (a mixed step's decode rows first) (q of the
    first `split` rows, q of the rest, k_pages, v_pages). Replaces XLA's two rotary concatenations
    of q and k, the q slice of a mixed step and the write kernel. KESTREL_JAX_PREFILL_QKV_KERNEL=0
    (read at trace time) keeps the XLA path for A/B runs."""
    if not _want_kernel() or not flag("KESTREL_JAX_PREFILL_QKV_KERNEL", True):
        return None
    from kestrel_jax.pallas import qkv_epilogue as kern

    rows = positions.shape[0]
    u = u[:rows]
    factors = None
    if tau is not None:  # traced only: where the kernel refuses them, the unused factors leave the program
        tau_q, tau_v, _ = kern.tau_factors(u, positions, tau, tau_gelu())
        factors = (tau_q, tau_v)
    if not 0 <= split < rows or kern.prefill_qkv_problem(u, k_pages, n_heads=n_heads, rotary_dim=rotary_dim,
                                                         factors=factors) is not None:
        return None
    return kern.prefill_qkv_kernel(
        u, positions, slots, k_pages, v_pages, k_scale, v_scale, n_heads=n_heads, rotary_dim=rotary_dim,
        theta=theta, factors=factors, split=split)


def route_in_qkv_wanted() -> bool:
    """Whether a decode MoE layer's routing tables are built in the QKV epilogue's launch
    (`decode_qkv_routed`) instead of a launch of their own. On by default: H100, twentieth session,
    the batch-1 decode step 1,766.8 -> 1,700.0 us (the 3.1 us routing launch gone from 20 layers;
    the epilogue 0.3 us longer), W1 657.96 / 657.96 -> 684.28 / 683.37 tok/s (A/B/A/B), hidden
    states bit-identical. KESTREL_JAX_ROUTE_IN_QKV=0 (read at trace time) restores the launch."""
    return flag("KESTREL_JAX_ROUTE_IN_QKV", True)


def decode_qkv_routed(u: jax.Array, positions: jax.Array, slots: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                      k_scale: jax.Array, v_scale: jax.Array, tau: Any, *, n_heads: int, rotary_dim: int, theta: float,
                      logits: jax.Array, num_valid: jax.Array | None, top_k: int, tau_dots: Any = None
                      ) -> tuple[jax.Array, jax.Array, jax.Array, Any] | None:
    """`decode_qkv` for an MoE layer whose router logits ([Nt, E], from the same decode GEMM
    launch) are at hand: with `route_in_qkv_wanted()`, and where the MoE's dense regime routes
    with the tables program at these shapes, the epilogue's launch also builds the routing tables
    (`qkv_epilogue.decode_qkv_route_kernel`): (q, k_pages, v_pages, `DenseRoute` for
    `moe_layer_rows`' `route`). Otherwise the fourth item is None (the MoE routes itself); None
    where `decode_qkv` is None. `tau_dots`: as `decode_qkv`'s."""
    route = None
    if _want_kernel() and route_in_qkv_wanted():
        from kestrel_jax.pallas import moe_mgpu

        rows = positions.shape[0]
        nt = moe_mgpu.tables_route_block_tokens(rows, logits.shape[1], top_k)
        if nt is not None and logits.shape[0] == nt:
            n_valid = jnp.asarray(rows if num_valid is None else num_valid, jnp.int32).reshape(1)
            route = (logits, n_valid, top_k, nt)
    out = _decode_qkv(u, positions, slots, k_pages, v_pages, k_scale, v_scale, tau, n_heads=n_heads,
                      rotary_dim=rotary_dim, theta=theta, route=route, tau_dots=tau_dots)
    if out is None:
        return None
    return out if len(out) == 4 else (*out, None)


def _decode_qkv(u: jax.Array, positions: jax.Array, slots: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                k_scale: jax.Array, v_scale: jax.Array, tau: Any, *, n_heads: int, rotary_dim: int, theta: float,
                route: tuple[jax.Array, jax.Array, int, int] | None, tau_dots: Any = None,
                u_cols: int | None = None) -> tuple | None:
    """`decode_qkv`'s dispatch; with `route` (logits, num_valid, top_k, block_tokens) the routing
    tables come back fourth where the routed kernel takes the logits."""
    if not _want_kernel() or not flag("KESTREL_JAX_DECODE_QKV_KERNEL", True):  # 0: A/B runs
        return None
    from kestrel_jax.pallas import qkv_epilogue as kern

    if route is not None and not kern.decode_qkv_route_supported(route[0], route[2]):
        route = None

    def call(u, tau, factors=None, dots=None):
        if route is None:
            return kern.decode_qkv_kernel(u, positions, slots, k_pages, v_pages, k_scale, v_scale, tau,
                                          n_heads=n_heads, rotary_dim=rotary_dim, theta=theta, factors=factors,
                                          tau_dots=dots)
        return kern.decode_qkv_route_kernel(u, positions, slots, k_pages, v_pages, k_scale, v_scale, tau, route[0],
                                            route[1], n_heads=n_heads, rotary_dim=rotary_dim, theta=theta,
                                            top_k=route[2], block_tokens=route[3], factors=factors, tau_dots=dots)

    if u_cols is not None:  # u wider than the QKV product (no routing): its first u_cols columns
        tau_w = None if tau_dots is not None else tau  # tau from the GEMM's dots, else from the row
        if route is not None or (tau_w is not None and positions.shape[0] > kern.MAX_TAU_ROWS) or (
                kern.decode_qkv_problem(u, k_pages, tau_w, n_heads=n_heads, rotary_dim=rotary_dim,
                                        tau_dots=tau_dots, u_cols=u_cols) is not None):
            return None
        return kern.decode_qkv_kernel(u, positions, slots, k_pages, v_pages, k_scale, v_scale, tau_w,
                                      n_heads=n_heads, rotary_dim=rotary_dim, theta=theta, tau_dots=tau_dots,
                                      u_cols=u_cols)
    rows = positions.shape[0]  # u may carry padding rows past them (`gemv_rows`): the kernel reads the first
    # With the dots a program reads 2 x (columns / 64) floats per head, not its whole row: any rows.
    if tau_dots is not None and kern.decode_qkv_problem(
            u, k_pages, None, n_heads=n_heads, rotary_dim=rotary_dim, tau_dots=tau_dots) is None:
        return call(u, None, dots=tau_dots)
    if tau is not None and rows > kern.MAX_TAU_ROWS:
        if not flag("KESTREL_JAX_TAU_FACTORS", True):
            return None
        u = u[:rows]
        # traced only: where the kernel refuses them, the unused factors leave the program
        tau_q, tau_v, _ = kern.tau_factors(u, positions, tau, tau_gelu())
        if kern.decode_qkv_problem(u, k_pages, None, n_heads=n_heads, rotary_dim=rotary_dim,
                                   factors=(tau_q, tau_v)) is not None:
            return None
        return call(u, None, (tau_q, tau_v))
    if kern.decode_qkv_problem(u, k_pages, tau, n_heads=n_heads, rotary_dim=rotary_dim) is not None:
        return None
    return call(u, tau)
