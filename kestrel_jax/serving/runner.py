"""The runner: owns the device state (params, KV pool) and the jitted fixed-shape steps.

Steps (each compiled once per bucket at start-up; a guard fails loudly on any later recompile):
  - vision: crops [n_bucket, 378, 378, 3] u8 -> features (per crop-count bucket), then the
    stitch/pool/projector per tiling -> image tokens [729, D];
  - prefill: a ragged batch of prompt chunks (T-token bucket, B sequences) -> per sequence the
    outputs of its last row (when its prompt completes);
  - mixed: a prefill step that also runs one decode iteration of a decode batch (continuous
    batching; one pass over both, per prefill bucket x mixed decode bucket);
  - decode: one position per row (B bucket), or K positions per row in one launch (a
    `lax.scan` over K iterations, each row feeding back its own sample: multi-step decode,
    compiled per bucket next to the single-step variant).
Each step ends in the same `StepOutputs`: the sampled token per row (each row's own sampling
settings and constraints), plus what the region skills need from that row's hidden state: the
decoded coordinate, the decoded size, and the detect/point continuation decision. Region heads
run for every row (see `_heads`: a `lax.cond` around them would sync the host mid-step).

Row inputs are a token id, a coordinate value, a size pair or (prefill) an image-token row:
the embedding is selected inside the step, so one compiled step serves every skill.
The KV pool (`KVCache`) is donated to every step and updated in place.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import gc
import logging
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import export

from kestrel_jax import xla_defaults
from kestrel_jax.models.device_crops import CANVAS, CropPlan, make_crops
from kestrel_jax.models.moondream import MoondreamModel
from kestrel_jax.models.region import coord_bin_to_value, size_bin_to_value
from kestrel_jax.models.text import AttentionBatch, DecodeRows, KVCache, region_kernel_rows
from kestrel_jax.models.vision import tile_pool_matrices
from kestrel_jax.pallas import ops
from kestrel_jax.pallas.paged_attention import init_kv_pool
from kestrel_jax.pallas.sampling import SamplingParams, sample
from kestrel_jax.serving import batch as bt
from kestrel_jax.serving.export_cache import ExportedStep, source_hash

log = logging.getLogger(__name__)

# Row input kinds.
IN_TOKEN, IN_COORD, IN_SIZE, IN_IMAGE = bt.IN_TOKEN, bt.IN_COORD, bt.IN_SIZE, bt.IN_IMAGE
# Bucket 1: a 1x1 tiling, whose only tile is the global crop's pixels, encodes that crop once
# (`Runner.encode_image`); two crops always mean a 1x1 tiling, so bucket 2 is not in the defaults.
VISION_CROP_BUCKETS = (1, 5, 7, 10, 13)
VISION_IMAGE_BATCHES = (2, 3, 4)


class RecompileError(RuntimeError):
    """A jitted step was traced again while serving: some input shape escaped its bucket."""


PAGE_QUANTUM = 64  # a KV pool sized from device memory is a multiple of this many pages


def client_memory_fraction() -> float:
    """The share of a GPU's memory JAX's client may use (`XLA_PYTHON_CLIENT_MEM_FRACTION`, 0.75 by
    default)."""
    try:
        return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
    except ValueError:
        return 0.75


def live_bytes(device: Any) -> int:
    """Bytes of the live JAX arrays held on `device` (their shards there)."""
    total = 0
    for a in jax.live_arrays():
        with contextlib.suppress(Exception):  # deleted or donated meanwhile
            if device in a.sharding.device_set:  # (read from the sharding: no shard arrays made)
                total += math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
    return total


def gpu_memory_info(device: Any) -> tuple[int, int] | None:
    """(free, total) bytes of a CUDA device as the driver counts them, or None (not a CUDA GPU, no
    driver library, or a driver error). Retains the device's primary context, which XLA uses, for
    the query only."""
    if getattr(device, "platform", None) != "gpu":
        return None
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    hw = getattr(device, "local_hardware_id", None)
    ordinal = int(device.id if hw is None else hw)
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    try:
        if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(dev), ordinal):
            return None
        if cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev):
            return None
        try:
            if cuda.cuCtxPushCurrent_v2(ctx):
                return None
            try:
                rc = cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
            finally:
                cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        finally:
            cuda.cuDevicePrimaryCtxRelease_v2(dev)
    except AttributeError:  # a driver library without these entry points
        return None
    return (int(free.value), int(total.value)) if rc == 0 and total.value else None


_JOIN_LOCK = threading.Lock()  # `TextModel.fuse_dense_decode` + split + unjoin, one runner at a time


@dataclass(frozen=True)
class RunnerConfig:
    page_size: int = 64
    num_pages: int | None = None  # None: sized from the device's free memory
    # Of the memory free after params, when num_pages is None. The rest stays for the steps'
    # temporaries (a 2048-token prefill of MD3 needs a few GiB).
    kv_memory_fraction: float = 0.6
    kv_dtype: str = "auto"  # "bf16" | "fp8" | "f32" | "auto" (fp8 on GPU when the checkpoint has KV scales)
    # A per-layer K/V scales file (`kestrel-jax calibrate-kv`, kestrel_jax/kv_scales.py) used in place
    # of the checkpoint's scales: with kv_dtype "auto" it turns the FP8 cache on on a GPU (MD2
    # checkpoints carry no scales); the model's `text.kv_scales` are replaced with the file's. None:
    # the checkpoint's (1.0 where it has none).
    kv_scales: str | None = None
    max_seq_len: int | None = None  # default: the model's context
    max_pages_per_seq: int | None = None  # default: ceil(max_seq_len / page_size)
    backend: str = "auto"  # kernel backend for attention / MoE / sampling
    vision_buckets: tuple[int, ...] = VISION_CROP_BUCKETS  # crop counts (global + tiles) compiled
    # One-crop images (1x1 tilings, with vision bucket 1) encoded together, one step for up to the
    # largest of these image counts (each compiled; a group is padded up to the next count). ():
    # each image on its own. A 378 px image's step alone leaves much of a large GPU idle.
    vision_image_batches: tuple[int, ...] = VISION_IMAGE_BATCHES
    compilation_cache_dir: str | None = None
    # Vision self-attention: "xla" (portable), "cudnn" (fused, NVIDIA GPUs) or "auto" (cudnn on
    # a GPU with a bf16 model when it runs there, else xla). cuDNN measured 1.4-1.7x faster for
    # the whole MD2 image step on an H100 (BENCHMARKS.md), outputs within bf16 rounding.
    vision_attention: str = "auto"
    # Overlap crops made on the device from the uploaded image (`models.device_crops`, byte-identical
    # to the host's PIL path) for images of at most `crop_canvas` pixels a side: "auto" (on a GPU),
    # "on" or "off". Larger images, and every image when off, are cropped on the host.
    device_crops: str = "auto"
    crop_canvas: int = CANVAS  # side of the uploaded image array on that path (larger images: host)
    # With a compilation cache directory: keep the lowered decode and prefill steps there too
    # (`export_cache`), so a restart skips tracing and lowering them.
    export_steps: bool = True
    # The device this runner's params, KV pool and steps live on: an index into jax.local_devices()
    # (one engine per device; `EngineConfig.num_devices` starts one per device).
    device: int = 0
    # The text steps' host inputs (numpy) put on the device with one jax.device_put before each call
    # instead of handed to the call. Measured on the H100 (BENCHMARKS.md, twenty-eighth session):
    # 64-client W2 the same either way (7,247-7,327 tok/s), a decode launch 4.2 vs 4.0 ms, a mixed
    # one 9.8 vs 11.0 ms. Off: kept for A/B runs.
    put_inputs: bool = False
    # The dense layers' QKV and fc1 weights also kept side by side for the decode steps' one product,
    # and their output projection's and fc2's stacked for another (`TextModel.fuse_dense_decode`;
    # MD2 at full size +1.4 + 1.0 GB, MD3 +0.23 + 0.17 GB): "auto" (on a GPU), "on" or "off".
    fused_dense_decode: str = "auto"
    # Multi-step decode launches whose rows need no region heads (plain answer / caption rows: all
    # but segment rows) run a step compiled without them (`_decode_step`'s `region`), which leaves
    # out the region encoders, heads and argmaxes that the region gate only makes cheap. False: every
    # decode launch runs the step with them (the default before; kept for A/B runs).
    text_steps: bool = True


class StepOutputs(NamedTuple):
    tokens: jax.Array  # [B] i32 sampled token
    logprobs: jax.Array  # [B] f32
    coord: jax.Array  # [B] f32 coordinate decoded from the row's hidden state (region rows)
    size: jax.Array  # [B, 2] f32 (width, height) decoded likewise
    region_next: jax.Array  # [B] i32 detect/point continuation: coord_id or eos_id

    def packed(self) -> jax.Array:
        """[B, 6] f32 (token ids are exact in f32 below 2^24): one device->host copy per step
        instead of five."""
        return jnp.stack([self.tokens.astype(jnp.float32), self.logprobs, self.coord, self.size[:, 0],
                          self.size[:, 1], self.region_next.astype(jnp.float32)], axis=1)


class LM(NamedTuple):
    """What the prefill and decode steps use of the model: the text decoder and region heads.
    The vision encoder's params stay out of these steps' arguments (half of MD2's arrays): every
    argument costs host time at each dispatch."""

    cfg: Any  # MoondreamConfig
    dtype: Any
    text: Any  # TextModel
    region: Any  # RegionModel


class _Parts(NamedTuple):
    """Static description of how to rebuild `LM` from a flat list of arrays."""

    cfg: Any
    dtype: Any
    text_gd: Any
    region_gd: Any
    treedef: Any


def put_host_arrays(args: tuple[Any, ...], device: Any) -> tuple[Any, ...]:
    """`args` with their numpy arrays put on `device`, all in one jax.device_put (one dispatch, not
    one per array); other arguments as they are."""
    host = [i for i, x in enumerate(args) if isinstance(x, np.ndarray)]
    out = list(args)
    for i, x in zip(host, jax.device_put([args[i] for i in host], device), strict=True):
        out[i] = x
    return tuple(out)


def _lm(parts: _Parts, params: list[jax.Array]) -> LM:
    text_state, region_state = jax.tree.unflatten(parts.treedef, params)
    return LM(parts.cfg, parts.dtype, nnx.merge(parts.text_gd, text_state), nnx.merge(parts.region_gd, region_state))


def _pinned(*arrays: jax.Array) -> list[jax.Array]:
    """A step's host inputs through `ops.pin_inputs` (one copy kernel, opt-in)."""
    return cast(list[jax.Array], list(ops.pin_inputs(*arrays)))  # no None in, none out


def _region_gate(ints: jax.Array, col: int) -> ops.Gate | None:
    """The region heads' gate (`ops.region_gate_wanted`): the step's "any row needs them" column."""
    return ops.gate(ints, 0, col) if ops.region_gate_wanted() else None


def _embed(model: LM, kind: jax.Array, token: jax.Array, value: jax.Array,
           image_row: jax.Array | None, images: jax.Array | None, gate: ops.Gate | None = None) -> jax.Array:
    """Per-row input embedding: wte[token], E_coord(value[0]), E_size(value) or an image row."""
    dtype = model.dtype
    x = model.text.embed(jnp.clip(token, 0, model.cfg.text.vocab_size - 1), dtype)
    rows = region_kernel_rows()
    coord = model.region.encode_coordinate(value[:, :1], dtype, kernel_rows=rows, gate=gate)
    size = model.region.encode_size(value, dtype, kernel_rows=rows, gate=gate)
    x = jnp.where((kind == IN_COORD)[:, None], coord, x)
    x = jnp.where((kind == IN_SIZE)[:, None], size, x)
    if images is not None and image_row is not None:
        flat = images.reshape(-1, images.shape[-1]).astype(dtype)
        img = flat[jnp.clip(image_row, 0, flat.shape[0] - 1)]
        x = jnp.where((kind == IN_IMAGE)[:, None], img, x)
    return x


def _sampling(ints: jax.Array, floats: jax.Array, top_k: int, seed: int, step: int, sup: int, temp: int,
              top_p: int, suppressed: jax.Array | None = None) -> SamplingParams:
    return SamplingParams(
        temperature=floats[:, temp], top_k=ints[:, top_k], top_p=floats[:, top_p],
        seed=jax.lax.bitcast_convert_type(ints[:, seed], jnp.uint32), step=ints[:, step],
        suppressed_ids=ints[:, sup: sup + bt.N_SUP] if suppressed is None else suppressed)


def _heads(model: LM, hidden: jax.Array, sp: SamplingParams, backend: str, out_rows: int,
           gate: ops.Gate | None = None, region: bool = True) -> jax.Array:
    """hidden [B, D] (pre post_ln) -> packed outputs [out_rows, 6] (see StepOutputs.packed).

    `region` off (a text decode step, `_decode_step`): no region heads and no continuation
    decision; the coordinate, size and region_next columns are zero.

    The region heads run for every row and every step. A `lax.cond` on "does any row need
    them" would make XLA copy the predicate to the host and wait for it in the middle of the
    step, stalling the dispatch of everything after it; the heads cost ~1% of a decode step. (With
    XLA's CONDITIONAL command buffers the predicate stays on the device, but such a conditional over
    the heads and encoders still measured slower: H100, fiftieth session, MD3 W1 795 -> 736 tok/s,
    two condition kernels and three copies more per step.) With
    `gate` their decode GEMMs skip their weight streams in steps whose rows need none of them."""
    tk = model.cfg.tokenizer
    # [B, V] in the model's dtype: the sampler and the comparisons below widen them to f32 exactly
    # (every bf16 value is an f32 value), so XLA runs no convert pass of the 51,200 logits of its own
    # (1.3-1.4 us per step on an H200, forty-seventh session; the sampling kernels read bf16 ~0.5 us
    # slower there, which no tile width changed in the forty-eighth session's sweep: about -1 us per
    # step in all).
    logits = model.text.model_logits(hidden)
    out = sample(logits, sp, return_logprobs=True, backend=backend)  # type: ignore[arg-type]
    assert out.logprobs is not None
    b = hidden.shape[0]
    if not region:
        coord, size, nxt = jnp.zeros((b,), jnp.float32), jnp.zeros((b, 2), jnp.float32), jnp.zeros((b,), jnp.int32)
    else:
        if model.cfg.is_md3:
            nxt = jnp.where(logits[:, tk.coord_id] >= logits[:, tk.eos_id], tk.coord_id, tk.eos_id)
        else:
            nxt = jnp.argmax(logits, axis=-1)
        coord_logits, size_logits = model.region.decode_heads(hidden, kernel_rows=region_kernel_rows(), gate=gate)
        coord = coord_bin_to_value(jnp.argmax(coord_logits, axis=-1))
        size = size_bin_to_value(jnp.argmax(size_logits, axis=-1))
    packed = StepOutputs(out.tokens, out.logprobs, coord, size, nxt.astype(jnp.int32)).packed()
    return jnp.pad(packed, ((0, out_rows - b), (0, 0)))


# Row buckets of the page-copy step (`Runner.copy_pages`). H100, seventh session: at the plans'
# 72 rows one copy step took ~0.39 ms (a gather of 72 pages from each of the 48 pools), 1.3% of the
# device time of 64 concurrent image queries, for the one tail page a new image prefix needs.
COPY_BUCKETS = (1, 4, 16)


def _copy_pages(cache: KVCache, copies: jax.Array, backend: str = "auto") -> KVCache:
    """Whole-page copies (all layers, K and V) src -> dst; rows with dst < 0 are skipped."""
    with ops.use_backend(backend):  # type: ignore[arg-type]
        (copies,) = _pinned(copies)
    src = jnp.clip(copies[:, 0], 0, cache.num_pages - 1)
    dst = jnp.where(copies[:, 1] < 0, cache.num_pages, copies[:, 1])  # out of range -> dropped
    k = tuple(kp.at[dst].set(kp[src], mode="drop") for kp in cache.k)
    v = tuple(vp.at[dst].set(vp[src], mode="drop") for vp in cache.v)
    return KVCache(k, v, cache.k_scale, cache.v_scale)


def _decode_inputs(model: LM, ints: jax.Array, floats: jax.Array, prev: jax.Array,
                   src: jax.Array, gate: ops.Gate | None = None,
                   region: bool = True) -> tuple[jax.Array, jax.Array]:
    """Decode rows (batch.py layout) -> (input embeddings [B, D], suppressed ids [B, N_SUP]); rows
    with src >= 0 take their input from row src of `prev`. `region` off (a text decode step): every
    input is a token's embedding (no coordinate or size encoder)."""
    tk = model.cfg.tokenizer
    use_prev = src >= 0
    p = prev[jnp.clip(src, 0, prev.shape[0] - 1)]
    p_tok = p[:, 0].astype(jnp.int32)
    reasoning = (ints[:, bt.D_FLAGS] & bt.FLAG_REASONING) != 0
    segment = (ints[:, bt.D_FLAGS] & bt.FLAG_SEGMENT) != 0
    kind = ints[:, bt.D_KIND]
    token = jnp.where(use_prev, p_tok, ints[:, bt.D_TOKEN])
    value = floats[:, bt.F_VAL0: bt.F_VAL1 + 1]
    p_coord = jnp.stack([p[:, 2], jnp.zeros_like(p[:, 2])], axis=1)
    # a reasoning or segment row that sampled the coordinate token feeds E_coord(its decoded
    # value); a segment row that sampled the size token, E_size(its decoded size)
    r_coord = use_prev & (reasoning | segment) & (p_tok == tk.coord_id)
    r_size = use_prev & segment & (p_tok == tk.size_id)
    kind = jnp.where(r_coord, IN_COORD, jnp.where(r_size, IN_SIZE, kind))
    value = jnp.where((use_prev & (kind == IN_COORD))[:, None], p_coord, value)
    value = jnp.where((use_prev & (kind == IN_SIZE))[:, None], p[:, 3:5], value)
    # a reasoning row that sampled the answer token feeds it and starts its answer: the next
    # sample is the answer's first, with nothing suppressed
    first_answer = use_prev & reasoning & (p_tok == tk.answer_id)
    sup = jnp.where(first_answer[:, None], -1, ints[:, bt.D_SUP: bt.D_SUP + bt.N_SUP])
    if not region:
        return model.text.embed(jnp.clip(token, 0, model.cfg.text.vocab_size - 1), model.dtype), sup
    return _embed(model, kind, token, value, None, None, gate), sup


class _LaunchRows(NamedTuple):
    """The operands of a decode launch that its iterations share, sliced from ints / floats once.

    A column slice of ints / floats handed to a kernel as is (the page table, the valid-row count,
    the sampler's settings) is a copy where it is sliced: XLA does not hoist slices out of a loop
    on its own, so sliced inside the multi-step loop's body they were copies in every iteration
    (`memcpy32_post`, ~1.1 us each on an H100). Sliced here once per launch: an 8-iteration batch-1
    launch -27 (MD2) / -34 (MD3) launches and -0.5% of its kernel time (BENCHMARKS.md, sixtieth
    session)."""

    table: jax.Array  # i32[B, P]
    num_valid: jax.Array  # i32[]
    temperature: jax.Array  # f32[B]
    top_k: jax.Array  # i32[B]
    top_p: jax.Array  # f32[B]
    seed: jax.Array  # u32[B]
    step: jax.Array  # i32[B]; the launch's first iteration's step counter

    def sampling(self, suppressed: jax.Array, step_offset: jax.Array | int = 0) -> SamplingParams:
        """The sampler's settings for the launch's iteration `step_offset`."""
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed,
                              step=self.step + step_offset, suppressed_ids=suppressed)


def _launch_rows(ints: jax.Array, floats: jax.Array) -> _LaunchRows:
    return _LaunchRows(ints[:, bt.DI:], ints[0, bt.D_NUM_VALID], floats[:, bt.F_TEMP], ints[:, bt.D_TOP_K],
                       floats[:, bt.F_TOP_P], jax.lax.bitcast_convert_type(ints[:, bt.D_SEED], jnp.uint32),
                       ints[:, bt.D_STEP])


def _decode_once(model: LM, cache: KVCache, ints: jax.Array, floats: jax.Array, rows: _LaunchRows, prev: jax.Array,
                 src: jax.Array, slots: jax.Array, positions: jax.Array, kv_lens: jax.Array,
                 step_offset: jax.Array | int, backend: str, out_rows: int,
                 region: bool = True) -> tuple[KVCache, jax.Array]:
    """One decode iteration; rows with src >= 0 take their input from row src of `prev`. `rows`:
    `_launch_rows(ints, floats)`, sliced outside the iterations' loop. `region` off: a text step
    (`_decode_step`)."""
    gate = _region_gate(ints, bt.D_REGION) if region else None
    x, sup = _decode_inputs(model, ints, floats, prev, src, gate, region)
    batch = AttentionBatch(positions, slots, kv_lens, rows.table, num_valid=rows.num_valid)
    hidden, cache, _ = model.text(x, batch, cache)
    return cache, _heads(model, hidden, rows.sampling(sup, step_offset), backend, out_rows, gate, region)


def _decode_step(parts: _Parts, params: list[jax.Array], cache: KVCache, ints: jax.Array, floats: jax.Array,
                 prev: jax.Array, backend: str, out_rows: int, steps: int,
                 region: bool = True) -> tuple[KVCache, jax.Array, jax.Array]:
    """ints [B, DI + P], floats [B, DF] (batch.py layout), prev [out_rows, 6] the previous step's
    packed outputs (rows with src >= 0 take their input from it).

    `steps` > 1 runs that many iterations in one launch (a loop with a static trip count, so no
    host round trip): iteration j feeds each row its own sample of iteration j - 1, writes
    position pos + j (slot from the row's page table) and samples with step counter step + j.
    Row i runs ints[i, D_NSTEPS] iterations; after those its writes are dropped (slot -1) and its
    outputs are ignored by the host. Returns (cache, outputs [steps, out_rows, 6], last
    [out_rows, 6] = each row's output of its last iteration, the next launch's `prev`).

    `region` off compiles a text step: for launches whose rows need no region heads in any
    iteration (batch.py's D_REGION 0: plain answer / caption rows, all a multi-step launch holds
    but segment rows), it leaves out the coordinate and size encoders, the region heads, their
    argmaxes and the continuation decision (their columns of the outputs are zero). The region gate
    skips those weight streams but not their ~10 launches per iteration (`Runner.decode`)."""
    model = _lm(parts, params)
    with ops.use_backend(backend):  # type: ignore[arg-type]
        ints, floats, prev = _pinned(ints, floats, prev)
        pos0, slot0, kv0 = ints[:, bt.D_POS], ints[:, bt.D_SLOT], ints[:, bt.D_KV_LEN]
        rows = _launch_rows(ints, floats)
        if steps == 1:
            cache, out = _decode_once(model, cache, ints, floats, rows, prev, ints[:, bt.D_SRC], slot0, pos0, kv0, 0,
                                      backend, out_rows, region)
            return cache, out[None], out
        b = ints.shape[0]
        n = ints[:, bt.D_NSTEPS]
        table = rows.table
        page = cache.page_size
        own = jnp.arange(b, dtype=jnp.int32)

        def body(carry: tuple[KVCache, jax.Array], j: jax.Array) -> tuple[tuple[KVCache, jax.Array], jax.Array]:
            cache, prev = carry
            adv = jnp.minimum(j, jnp.maximum(n - 1, 0))
            pos = pos0 + adv
            kv = jnp.where(kv0 > 0, kv0 + adv, 0)
            page_of = jnp.take_along_axis(table, jnp.clip(pos // page, 0, table.shape[1] - 1)[:, None], axis=1)[:, 0]
            slot = jnp.where(j == 0, slot0, jnp.where(j < n, page_of * page + pos % page, -1))
            src = jnp.where(j == 0, ints[:, bt.D_SRC], own)
            cache, out = _decode_once(model, cache, ints, floats, rows, prev, src, slot, pos, kv, j, backend,
                                      out_rows, region)
            return (cache, out), out

        (cache, _), outs = jax.lax.scan(body, (cache, prev), jnp.arange(steps, dtype=jnp.int32))
        last_iter = jnp.clip(n - 1, 0, steps - 1)
        last = outs[last_iter, own]  # [B, 6]
        last = jnp.pad(last, ((0, out_rows - b), (0, 0)))
        return cache, outs, last


def _prefill_step(parts: _Parts, params: list[jax.Array], cache: KVCache, tok_ints: jax.Array,
                  tok_floats: jax.Array, seq_ints: jax.Array, seq_floats: jax.Array, images: jax.Array,
                  backend: str, out_rows: int) -> tuple[KVCache, jax.Array]:
    """tok_ints [T, TI], tok_floats [T, 2], seq_ints [B, SI + P], seq_floats [B, 2] (batch.py
    layout), images [NI, 729, D]: per-sequence outputs of each completed prompt's last row."""
    return _prefill_or_mixed(_lm(parts, params), cache, tok_ints, tok_floats, seq_ints, seq_floats, images, None,
                             backend, out_rows)


def _mixed_step(parts: _Parts, params: list[jax.Array], cache: KVCache, ints: jax.Array, floats: jax.Array,
                prev: jax.Array, tok_ints: jax.Array, tok_floats: jax.Array, seq_ints: jax.Array,
                seq_floats: jax.Array, images: jax.Array, backend: str, out_rows: int) -> tuple[KVCache, jax.Array]:
    """A prefill step that also runs one decode iteration of the rows `ints [Bd, DI + P]`, `floats
    [Bd, DF]` (the decode step's layout and `prev` feed): one forward pass over Bd + T tokens, decode
    rows first. Outputs: rows [0, Bd) the decode rows', then [Bd, Bd + B) the prefill sequences'."""
    return _prefill_or_mixed(_lm(parts, params), cache, tok_ints, tok_floats, seq_ints, seq_floats, images,
                             (ints, floats, prev), backend, out_rows)


def _prefill_or_mixed(model: LM, cache: KVCache, tok_ints: jax.Array, tok_floats: jax.Array, seq_ints: jax.Array,
                      seq_floats: jax.Array, images: jax.Array, decode: tuple[jax.Array, jax.Array, jax.Array] | None,
                      backend: str, out_rows: int) -> tuple[KVCache, jax.Array]:
    with ops.use_backend(backend):  # type: ignore[arg-type]
        tok_ints, tok_floats, seq_ints, seq_floats, *rest = _pinned(tok_ints, tok_floats, seq_ints, seq_floats,
                                                                      *(decode or ()))
        decode = (rest[0], rest[1], rest[2]) if rest else None
        gate = _region_gate(tok_ints, bt.T_REGION)  # a mixed step's covers its decode rows too
        x = _embed(model, tok_ints[:, bt.T_KIND], tok_ints[:, bt.T_TOKEN], tok_floats, tok_ints[:, bt.T_IMG_ROW],
                   images, gate)
        cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), seq_ints[:, bt.S_CU_END]])
        positions, slots, num_valid = tok_ints[:, bt.T_POS], tok_ints[:, bt.T_SLOT], tok_ints[0, bt.T_NUM_VALID]
        rows, sp, nd = None, _sampling(seq_ints, seq_floats, bt.S_TOP_K, bt.S_SEED, bt.S_STEP, bt.S_SUP, 0, 1), 0
        if decode is not None:
            ints, floats, prev = decode
            nd = ints.shape[0]
            xd, sup = _decode_inputs(model, ints, floats, prev, ints[:, bt.D_SRC], gate)
            x = jnp.concatenate([xd, x])
            positions = jnp.concatenate([ints[:, bt.D_POS], positions])
            slots = jnp.concatenate([ints[:, bt.D_SLOT], slots])
            num_valid = num_valid + nd  # the decode rows' padding runs too: it sits before real rows
            rows = DecodeRows(nd, ints[:, bt.D_KV_LEN], ints[:, bt.DI:])
            sp = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), _launch_rows(ints, floats).sampling(sup), sp)
        batch = AttentionBatch(positions, slots, seq_ints[:, bt.S_KV_LEN], seq_ints[:, bt.SI:], cu,
                               seq_ints[:, bt.S_PREFIX], num_valid, rows)
        hidden, cache, _ = model.text(x, batch, cache)
        last = hidden[nd + jnp.clip(seq_ints[:, bt.S_LOGITS_ROW], 0, tok_ints.shape[0] - 1)]  # [B, D]
        if nd:
            last = jnp.concatenate([hidden[:nd], last])
        return cache, _heads(model, last, sp, backend, out_rows, gate)


def _vision_step(graphdef: Any, treedef: Any, dtype: Any, attn: str | None, params: list[jax.Array],
                 crops: jax.Array, pool_rows: jax.Array, pool_cols: jax.Array) -> jax.Array:
    vision = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))
    return vision.encode_padded(crops, pool_rows, pool_cols, dtype, attn)


def _vision_images_step(graphdef: Any, treedef: Any, dtype: Any, attn: str | None, params: list[jax.Array],
                        crops: tuple[jax.Array, ...], pool_rows: jax.Array, pool_cols: jax.Array
                        ) -> tuple[jax.Array, ...]:
    """One-crop images [1, S, S, 3] each -> each image's tokens [g*g, D] (own buffers)."""
    vision = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))
    out = vision.encode_singles(jnp.concatenate(crops), pool_rows, pool_cols, dtype, attn)
    return tuple(out[i] for i in range(len(crops)))


def _cudnn_attention_works() -> bool:
    """One tiny fused-attention call: cuDNN may be missing or too old on a GPU host."""
    try:
        x = jnp.zeros((1, 16, 2, 64), jnp.bfloat16)
        jax.block_until_ready(jax.nn.dot_product_attention(x, x, x, implementation="cudnn"))
        return True
    except Exception as e:  # noqa: BLE001 - any failure means: use the portable path
        log.warning("cuDNN attention unavailable (%s); the vision encoder uses XLA attention", e)
        return False


def _vision_attention(name: str, dtype: Any) -> str | None:
    if name == "auto":
        usable = jax.default_backend() == "gpu" and jnp.dtype(dtype) == jnp.bfloat16
        return "cudnn" if usable and _cudnn_attention_works() else None
    if name not in ("xla", "cudnn"):
        raise ValueError(f"vision_attention must be auto, xla or cudnn; got {name!r}")
    return None if name == "xla" else name


def _kv_dtype(name: str, model: MoondreamModel) -> jnp.dtype:
    if name == "auto":
        on_gpu = jax.default_backend() == "gpu"
        has_scales = bool(np.any(np.asarray(model.text.kv_scales[...]) != 1.0))
        return jnp.float8_e4m3fn if (on_gpu and has_scales) else model.dtype
    table = {"bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn, "f32": jnp.float32,
             "float32": jnp.float32}
    if name not in table:
        raise ValueError(f"kv_dtype must be auto, bf16, fp8 or f32; got {name!r}")
    return table[name]


class Runner:
    """Device owner. Not thread-safe: one engine thread drives it."""

    def __init__(self, model: MoondreamModel, config: RunnerConfig | None = None, *, out_rows: int = 64):
        """`out_rows`: rows of every step's packed output (>= the largest decode bucket and the
        prefill batch), so any step can feed the next from it."""
        self.config = config or RunnerConfig()
        self.out_rows = out_rows
        if self.config.compilation_cache_dir:
            os.makedirs(self.config.compilation_cache_dir, exist_ok=True)
            jax.config.update("jax_compilation_cache_dir", self.config.compilation_cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        self.model = model
        self.cfg = model.cfg
        devices = jax.local_devices()
        if not 0 <= self.config.device < len(devices):
            raise ValueError(f"device {self.config.device} does not exist: this process has {len(devices)} local "
                             f"device(s)")
        self.device = devices[self.config.device]
        t = self.cfg.text
        self.max_seq_len = self.config.max_seq_len or t.max_context
        self.page_size = self.config.page_size
        self.max_pages_per_seq = self.config.max_pages_per_seq or -(-self.max_seq_len // self.page_size)
        if self.config.kv_scales:  # before the KV dtype is chosen: "auto" looks at the scales
            from kestrel_jax import kv_scales

            kv_scales.apply(model, kv_scales.load(self.config.kv_scales, t.n_layers))
        self.kv_dtype = _kv_dtype(self.config.kv_dtype, model)
        if self.config.kv_scales and jnp.dtype(self.kv_dtype) != jnp.dtype(jnp.float8_e4m3fn):
            log.warning("KV scales file %s has no effect: the KV cache is %s (scales apply to an FP8 cache; "
                        "kv_dtype 'auto' picks FP8 on a GPU only)", self.config.kv_scales, jnp.dtype(self.kv_dtype))
        self.vision_buckets = tuple(sorted(self.config.vision_buckets))
        self.image_batches = tuple(sorted(self.config.vision_image_batches)) if 1 in self.vision_buckets else ()
        if any(g < 2 for g in self.image_batches):
            raise ValueError(f"vision_image_batches are image counts >= 2, got {self.config.vision_image_batches}")
        if self.config.fused_dense_decode not in ("auto", "on", "off"):
            raise ValueError(f"fused_dense_decode must be auto, on or off; got {self.config.fused_dense_decode!r}")
        fused = self.config.fused_dense_decode == "on" or (
            self.config.fused_dense_decode == "auto" and getattr(self.device, "platform", "cpu") == "gpu")
        # Params travel as flat lists (dispatching a flat list of arrays is much cheaper per step
        # than flattening the nested module state on every call): the text decoder and region
        # heads for prefill/decode, the vision encoder for the vision step. The joined weights are
        # made on this runner's device and held by its params only: the model carries them just
        # for the split, under a lock (an engine starts one runner per device at once, all on one
        # model).
        with _JOIN_LOCK:
            try:
                self.joined_dense_bytes = model.text.fuse_dense_decode(fused, device=self.device)
                text_gd, text_state = nnx.split(model.text)
            finally:
                model.text.fuse_dense_decode(False)
        if self.joined_dense_bytes:
            log.info("dense layers' decode weights joined (QKV + fc1, proj + fc2): +%.2f GB",
                     self.joined_dense_bytes / 1e9)
        region_gd, region_state = nnx.split(model.region)
        self.lm_params, lm_treedef = jax.tree.flatten((text_state, region_state))
        self._parts = _Parts(model.cfg, model.dtype, text_gd, region_gd, lm_treedef)
        vision_gd, vision_state = nnx.split(model.vision)
        self.vision_params, vision_treedef = jax.tree.flatten(vision_state)
        self.num_pages = self.config.num_pages or self._pages_from_memory()
        if getattr(self.device, "platform", "cpu") == "gpu" and not xla_defaults.command_buffers_skip_temp():
            how = xla_defaults.applied().get("xla_gpu_command_buffer_update_mode", "")
            why = {"late": "JAX's backend started before kestrel_jax was imported",
                   "off": f"{xla_defaults.OPT_OUT}=0", "user": "XLA_FLAGS sets another mode"}.get(how, "not applied")
            (log.warning if how == "late" else log.info)(
                "XLA updates each step's command buffer at every call whose temporaries moved (SKIP_TEMP not "
                "in effect: %s; see kestrel_jax/xla_defaults.py): step launches cost more host time", why)
        pool = init_kv_pool(t.n_layers, self.num_pages, self.page_size, t.n_kv_heads, t.head_dim, self.kv_dtype)
        # [L] arrays: each layer's scale is sliced inside the step (and handed to the kernels
        # through `own_buffer`, since Mosaic kernels require 256-byte aligned operands).
        scales = jnp.asarray(model.text.kv_scales[...], jnp.float32)
        self.cache = _committed(KVCache(tuple(k for k, _ in pool), tuple(v for _, v in pool), scales[:, 0],
                                        scales[:, 1]), self.device)
        self.lm_params = _committed(self.lm_params, self.device)
        self.vision_params = _committed(self.vision_params, self.device)
        backend = self.config.backend
        self._backend = backend
        self._decode: dict[tuple[int, bool], Any] = {}  # (iterations per launch, region heads) -> jitted step
        export_dir = (os.path.join(self.config.compilation_cache_dir, "kestrel_jax_export")
                      if self.config.compilation_cache_dir and self.config.export_steps else None)
        self._step = functools.partial(ExportedStep, donate_argnums=(1,), directory=export_dir,
                                       salt=self._export_salt(), version=f"{source_hash()}|{jax.__version__}")
        self._prefill = self._step("prefill", functools.partial(_prefill_step, self._parts, backend=backend,
                                                                out_rows=out_rows))
        self._mixed = self._step("mixed", functools.partial(_mixed_step, self._parts, backend=backend,
                                                            out_rows=out_rows))
        # Each runner jits its own callable (a fresh partial): jit shares one executable cache among
        # wrappers of the same function, and `freeze` counts a step's variants in that cache, so two
        # runners (one per device) of a module-level function would see each other's compiles.
        self._copy = jax.jit(functools.partial(_copy_pages, backend=self._backend), donate_argnums=(0,))
        self.no_outputs = _committed(jnp.zeros((out_rows, 6), jnp.float32), self.device)
        attn = _vision_attention(self.config.vision_attention, model.dtype)
        self._vision = jax.jit(functools.partial(_vision_step, vision_gd, vision_treedef, model.dtype, attn))
        self._vision_images = jax.jit(functools.partial(_vision_images_step, vision_gd, vision_treedef,
                                                        model.dtype, attn))
        if self.config.device_crops not in ("auto", "on", "off"):
            raise ValueError(f"device_crops must be auto, on or off; got {self.config.device_crops!r}")
        self.device_crops = (self.config.device_crops == "on"
                             or (self.config.device_crops == "auto" and jax.default_backend() == "gpu"))
        self._crops = jax.jit(functools.partial(make_crops))
        self.images = {"device_crops": 0, "host_crops": 0}  # images encoded, by where their crops were made
        # constant vision-step inputs, put on the device once: (tiling, tiles) -> pooling weights,
        # and the blank crop that pads a batch of one-crop images
        self._pool_weights: dict[tuple[int, int, int], tuple[jax.Array, jax.Array]] = {}
        self._blank_crop: jax.Array | None = None
        self._frozen: dict[str, int] | None = None

    # RunnerConfig fields that do not shape the text steps (the vision step is not exported; the pool's
    # size is in the steps' input shapes): left out of the export salt, so that runs differing only
    # in these share the exported steps. Any other field, including one added later, is in the salt.
    _NOT_IN_STEPS = frozenset({"num_pages", "kv_memory_fraction", "vision_buckets", "compilation_cache_dir",
                               "vision_attention", "device_crops", "crop_canvas", "export_steps",
                               "vision_image_batches", "device", "put_inputs"})

    def _on(self, x: Any) -> Any:
        """Host arrays (or a tuple of them) onto this runner's device, committed."""
        return jax.device_put(x, self.device)

    def _inputs(self, *args: Any) -> tuple[Any, ...]:
        """A text step's inputs as its call takes them: with `put_inputs`, the numpy ones put on the
        device first (committed; every call, warm-up and compile-ahead alike, so one signature)."""
        return put_host_arrays(args, self.device) if self.config.put_inputs else args

    def _export_salt(self) -> str:
        """Everything besides input shapes and code that shapes a step's program (see export_cache)."""
        dev = self.device
        fields = {f.name: getattr(self.config, f.name) for f in dataclasses.fields(self.config)
                  if f.name not in self._NOT_IN_STEPS}
        # the KESTREL_JAX_* switches that pick kernels at trace time (A/B runs) shape the programs too
        switches = sorted((k, v) for k, v in os.environ.items() if k.startswith("KESTREL_JAX_"))
        return "|".join(map(str, (dev.platform, dev.device_kind, self.cfg, sorted(fields.items()), self.out_rows,
                                  jnp.dtype(self.kv_dtype), jnp.dtype(self.model.dtype), switches)))

    @property
    def export_counts(self) -> dict[str, int]:
        """Decode and prefill step variants loaded from / exported to the export cache, or traced
        as usual after a failure (`fallback`)."""
        out = {"loaded": 0, "exported": 0, "fallback": 0}
        for fn in (self._prefill, self._mixed, *self._decode.values()):
            for k, v in fn.counts.items():
                out[k] += v
        return out

    # ------------------------------------------------------------------------------- sizing
    def kv_bytes_per_page(self) -> int:
        t = self.cfg.text
        return 2 * t.n_layers * t.n_kv_heads * t.head_dim * self.page_size * jnp.dtype(self.kv_dtype).itemsize

    def _pages_from_memory(self) -> int:
        dev = self.device
        # What is in use must not depend on timing: computations still running (random weights
        # made on the device hold their temporaries until done) and unreachable arrays awaiting
        # the garbage collector made two processes size 5056 vs 4800 pages (tenth session), and
        # the second one compiled every step again.
        jax.block_until_ready((self.lm_params, self.vision_params))
        gc.collect()
        stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
        need = self.max_pages_per_seq * 8  # a floor: room for 8 full-length sequences
        info: tuple[int, int] | None = None
        if stats and "bytes_limit" in stats:
            limit, in_use = int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))
        else:
            # XLA's VMM allocator (taken with SKIP_TEMP command buffers, xla_defaults.py) keeps no
            # statistics: the budget is the client's share of the device's memory (what the BFC
            # allocator's bytes_limit is), in use are the live arrays on the device (what its
            # bytes_in_use counts). The driver's used figure is not it: the VMM allocator keeps
            # freed memory mapped for reuse (call 4 of the twenty-ninth session: 20.5 GB used with
            # ~13 GB of arrays, a 4,096-page pool instead of 4,800).
            info = gpu_memory_info(dev)
            if info is None:
                if getattr(dev, "platform", "cpu") != "cpu":
                    log.warning("no memory figures for %s: the KV pool gets %d pages (set "
                                "RunnerConfig.num_pages to size it)", dev, need)
                return need  # CPU: no budget to size against
            free, total = info
            limit, in_use = int(total * client_memory_fraction()), live_bytes(dev)
        # Sized from the memory the params leave, not from what happens to be free right now: the
        # pool's shape is part of every step's compiled program, and a count that moved by a page
        # between runs (it did, 4823 vs 4824) made every decode and prefill step miss the
        # persistent compilation cache. Rounded down to PAGE_QUANTUM pages for the same reason.
        params = sum(int(a.nbytes) for a in (*self.lm_params, *self.vision_params))

        def quantised(nbytes: float) -> int:
            p = int(nbytes * self.config.kv_memory_fraction) // self.kv_bytes_per_page()
            return p // PAGE_QUANTUM * PAGE_QUANTUM if p >= 2 * PAGE_QUANTUM else p

        pages = quantised(limit - params)
        if in_use - params > 0.05 * (limit - params):  # something else holds real memory: respect it
            pages = min(pages, quantised(limit - in_use))
        if info is not None and pages * self.kv_bytes_per_page() > free:  # other processes hold it
            pages = min(pages, quantised(free))
        if pages < self.max_pages_per_seq:
            raise MemoryError(f"only {pages} KV pages fit in free device memory; a single "
                              f"{self.max_seq_len}-token sequence needs {self.max_pages_per_seq}")
        return pages

    # ------------------------------------------------------------------------------- vision
    def crops_to_encode(self, crops: np.ndarray | CropPlan, tiling: tuple[int, int], *,
                        share_tile: bool = True) -> tuple[np.ndarray | CropPlan, int]:
        """(the crops the image step encodes, their count): the global crop alone for a 1x1
        tiling whose tile has its pixels, when vision bucket 1 is compiled (see `encode_image`)."""
        n = crops.num_crops if isinstance(crops, CropPlan) else crops.shape[0]
        if share_tile and n == 2 and tuple(tiling) == (1, 1) and 1 in self.vision_buckets and _same_crops(crops):
            return (crops.take(1) if isinstance(crops, CropPlan) else crops[:1]), 1
        return crops, n

    def encode_image(self, crops: np.ndarray | CropPlan, tiling: tuple[int, int], *,
                     share_tile: bool = True) -> jax.Array:
        """uint8 crops [n, S, S, 3], or a `CropPlan` whose crops the device makes first, -> image
        tokens [729, D] on the device (one fixed-shape step per crop-count bucket; the tiling
        enters as pooling weights, not as a shape).

        An image with a 1x1 tiling (small images: every one up to 378 px a side) has two crops with the
        same pixels: the global crop and its only tile are the same resize. With a bucket of 1
        compiled, that crop is encoded once and its features serve as both (half the encoder's
        work for such images; the outputs are the two-crop encoding's, up to GEMM rounding).
        `share_tile=False` encodes both (the warm-up compiles every bucket that way)."""
        crops, n = self.crops_to_encode(crops, tiling, share_tile=share_tile)
        bucket = next((b for b in self.vision_buckets if b >= n), None)
        if bucket is None:
            # The reference's tiling rule allows more than 13 crops for extreme aspect ratios.
            raise ValueError(f"an image of {n} crops exceeds the largest vision bucket "
                             f"({self.vision_buckets[-1]}); extend RunnerConfig.vision_buckets")
        if isinstance(crops, CropPlan):
            batch = self._guarded("crops", self._crops, *self._on(crops.padded(bucket)))
            self.images["device_crops"] += 1
        else:
            self.images["host_crops"] += 1
            pad = np.zeros((bucket - n, *crops.shape[1:]), np.uint8)
            batch = self._on(np.concatenate([crops, pad]))
        # bucket 1: the global crop is also the one tile (`VisionEncoder.encode_padded`)
        rows, cols = self._pooling(tiling, max(1, bucket - 1))
        return self._guarded("vision", self._vision, self.vision_params, batch, rows, cols)

    def _pooling(self, tiling: tuple[int, int], tiles: int) -> tuple[jax.Array, jax.Array]:
        """The stitch + pooling weights of a tiling (`tile_pool_matrices`), on the device. Made and put
        there once per tiling and bucket: a step's host inputs are transferred at every call, and under
        SKIP_TEMP command buffers (xla_defaults.py) every graph node that reads an input whose address
        moved is updated before the launch; these stay put. (At most one entry per tiling the
        crop rule allows and bucket: a few dozen arrays of a few KB. The vision thread and the
        engine thread, encoding in place, may both get here: a race puts one copy twice, no harm.)"""
        key = (int(tiling[0]), int(tiling[1]), int(tiles))
        got = self._pool_weights.get(key)
        if got is None:
            got = self._pool_weights[key] = self._on(tile_pool_matrices(key[:2], self.cfg.vision, tiles))
        return got

    def encode_images(self, images: list[tuple[np.ndarray | CropPlan, tuple[int, int]]]) -> list[jax.Array]:
        """Several images' (crops, tiling) -> each image's tokens [729, D], as `encode_image` gives
        them (up to GEMM rounding). One-crop images go together, in steps of up to the largest
        `vision_image_batches` count (padded with blank crops up to a compiled count); the others,
        and a lone one-crop image, one step each."""
        out: list[jax.Array | None] = [None] * len(images)
        singles: list[tuple[int, np.ndarray | CropPlan]] = []
        for i, (crops, tiling) in enumerate(images):
            one, n = self.crops_to_encode(crops, tiling)
            if n == 1 and self.image_batches:
                singles.append((i, one))
            else:
                out[i] = self.encode_image(crops, tiling)
        most = self.image_batches[-1] if self.image_batches else 1
        for start in range(0, len(singles), most):
            group = singles[start:start + most]
            if len(group) == 1:
                i, one = group[0]
                out[i] = self.encode_image(one, (1, 1))
                continue
            for i, tokens in zip((i for i, _ in group), self.encode_singles([one for _, one in group]), strict=False):
                out[i] = tokens
        assert all(o is not None for o in out)
        return out  # type: ignore[return-value]

    def encode_singles(self, crops: list[np.ndarray | CropPlan]) -> tuple[jax.Array, ...]:
        """One-crop images (each [1, S, S, 3] or its plan; at most the largest image count) in one
        step: their tokens in order, then the padding's."""
        count = next((g for g in self.image_batches if g >= len(crops)), None)
        if count is None:
            raise ValueError(f"{len(crops)} images exceed the largest one-step image count {self.image_batches}")
        batch: list[jax.Array] = []
        for c in crops:  # device arrays either way (one jit signature for both)
            if isinstance(c, CropPlan):
                batch.append(self._guarded("crops", self._crops, *self._on(c.padded(1))))
                self.images["device_crops"] += 1
            else:
                batch.append(self._on(c))
                self.images["host_crops"] += 1
        if count > len(crops):
            if self._blank_crop is None:
                vis = self.cfg.vision
                self._blank_crop = self._on(np.zeros((1, vis.crop_size, vis.crop_size, 3), np.uint8))
            batch += [self._blank_crop] * (count - len(crops))
        rows, cols = self._pooling((1, 1), 1)
        return self._guarded("vision_images", self._vision_images, self.vision_params, tuple(batch), rows, cols)

    # ------------------------------------------------------------------------------- steps
    @staticmethod
    def _decode_name(steps: int, region: bool) -> str:
        return f"decode{steps}" if region else f"decode{steps}_text"

    def _decode_fn(self, steps: int, region: bool = True) -> Any:
        fn = self._decode.get((steps, region))
        if fn is None:
            name = self._decode_name(steps, region)
            if self._frozen is not None:
                raise RecompileError(f"no {steps}-iteration decode step ({name}) was compiled at start-up")
            fn = self._step(name, functools.partial(_decode_step, self._parts, backend=self._backend,
                                                    out_rows=self.out_rows, steps=steps, region=region))
            self._decode[(steps, region)] = fn
        return fn

    def decode_region(self, ints: np.ndarray, steps: int) -> bool:
        """Whether a decode launch of these rows (batch.py layout) runs the step with the region
        heads: every one-iteration launch does, and a multi-step launch whose D_REGION column is
        set (a segment row); the others run the text step (`_decode_step`'s `region` off, with
        `RunnerConfig.text_steps`)."""
        return steps == 1 or not self.config.text_steps or bool(np.any(np.asarray(ints)[:, bt.D_REGION]))

    def decode(self, ints: np.ndarray, floats: np.ndarray, prev: jax.Array | None,
               steps: int = 1) -> tuple[jax.Array, jax.Array]:
        """Dispatch a decode launch of `steps` iterations (batch.py layout) without waiting.
        Returns (outputs [steps, out_rows, 6], last [out_rows, 6]: each row's output of its last
        iteration). `prev`: the previous launch's `last` (for rows with src >= 0)."""
        region = self.decode_region(ints, steps)
        fn = self._decode_fn(steps, region)
        self.cache, outs, last = self._guarded(self._decode_name(steps, region), fn, self.lm_params, self.cache,
                                               *self._inputs(ints, floats, self._feed(prev)))
        return outs, last

    def prefill(self, tok_ints: np.ndarray, tok_floats: np.ndarray, seq_ints: np.ndarray, seq_floats: np.ndarray,
                images: jax.Array) -> jax.Array:
        self.cache, out = self._guarded("prefill", self._prefill, self.lm_params, self.cache,
                                        *self._inputs(tok_ints, tok_floats, seq_ints, seq_floats, images))
        return out

    def mixed(self, ints: np.ndarray, floats: np.ndarray, prev: jax.Array | None, tok_ints: np.ndarray,
              tok_floats: np.ndarray, seq_ints: np.ndarray, seq_floats: np.ndarray, images: jax.Array) -> jax.Array:
        """A prefill step carrying one decode iteration of the rows `ints`/`floats` (decode layout,
        `prev` as for `decode`). Outputs [out_rows, 6]: the decode rows', then the sequences'."""
        self.cache, out = self._guarded("mixed", self._mixed, self.lm_params, self.cache,
                                        *self._inputs(ints, floats, self._feed(prev), tok_ints, tok_floats, seq_ints,
                                                      seq_floats, images))
        return out

    def compile_ahead(self, calls: list[tuple[str, tuple[Any, ...]]], threads: int) -> None:
        """Lower and compile step variants on `threads` threads without running them (XLA
        compiles, and reads its cache, with the GIL released; nothing is donated). Each call is
        (method, arguments) of a later `decode`, `prefill` or `mixed` call, which then finds its
        variant compiled."""
        jobs: list[tuple[ExportedStep, tuple[Any, ...]]] = []
        for kind, args in calls:
            if kind == "decode":
                ints, floats, prev, steps = args
                jobs.append((self._decode_fn(steps, self.decode_region(ints, steps)),
                             self._inputs(ints, floats, self._feed(prev))))
            elif kind == "prefill":
                jobs.append((self._prefill, self._inputs(*args)))
            elif kind == "mixed":
                ints, floats, prev, *rest = args
                jobs.append((self._mixed, self._inputs(ints, floats, self._feed(prev), *rest)))
            else:
                raise ValueError(f"unknown step kind {kind!r}")
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="kestrel-jax-compile") as pool:
            list(pool.map(lambda job: job[0].compile_ahead(self.lm_params, self.cache, *job[1]), jobs))

    def _feed(self, prev: jax.Array | None) -> jax.Array:
        return self.no_outputs if prev is None else prev

    def copy_pages(self, copies: np.ndarray, num_copies: int | None = None) -> None:
        """Whole-page KV copies [C, 2] (src, dst), dispatched before the step that needs them. The
        first `num_copies` rows are the real ones (None: all); the step runs over the smallest
        compiled row bucket holding them, since every row costs a page of all layers read and
        written (a plan's array has room for `max_copies`, dozens, while most steps copy one)."""
        n = len(copies) if num_copies is None else num_copies
        rows = next((b for b in COPY_BUCKETS if n <= b < len(copies)), len(copies))
        self.cache = self._guarded("copy", self._copy, self.cache, copies[:rows])

    @staticmethod
    def copy_buckets(max_copies: int) -> tuple[int, ...]:
        """Row counts `copy_pages` runs with for plans of `max_copies` rows (compile each)."""
        return tuple(b for b in COPY_BUCKETS if b < max_copies) + (max_copies,)

    def recover(self) -> bool:
        """After a failed step: if the donated KV pool was consumed, allocate a fresh one.
        Returns True when the KV contents were lost (every live sequence must be failed)."""
        if not any(a.is_deleted() for a in (*self.cache.k, *self.cache.v)):
            return False
        t = self.cfg.text
        pool = init_kv_pool(t.n_layers, self.num_pages, self.page_size, t.n_kv_heads, t.head_dim, self.kv_dtype)
        self.cache = KVCache(_committed(tuple(k for k, _ in pool), self.device),
                             _committed(tuple(v for _, v in pool), self.device), self.cache.k_scale, self.cache.v_scale)
        return True

    # ------------------------------------------------------------------------------- guard
    def _fns(self) -> dict[str, Any]:
        fns = {"prefill": self._prefill, "mixed": self._mixed, "vision": self._vision, "copy": self._copy,
               "crops": self._crops, "vision_images": self._vision_images}
        fns.update({self._decode_name(k, region): fn for (k, region), fn in self._decode.items()})
        return fns

    def freeze(self) -> None:
        """After warm-up: any further trace of a step is an error (a shape escaped its bucket)."""
        self._frozen = {name: fn._cache_size() for name, fn in self._fns().items()}

    def unfreeze(self) -> None:
        self._frozen = None

    def _guarded(self, name: str, fn: Any, *args: Any) -> Any:
        out = fn(*args)
        if self._frozen is not None:
            size = fn._cache_size()
            if size != self._frozen[name]:
                self._frozen[name] = size
                raise RecompileError(f"the {name} step was compiled again while serving "
                                     f"(now {size} variants): an input escaped its bucket")
        return out


# The KV pool crosses exported steps: its tuple type must be serializable by name (a module reload
# finds it registered already).
with contextlib.suppress(ValueError):
    export.register_namedtuple_serialization(KVCache, serialized_name="kestrel_jax.models.text.KVCache")


def _committed(tree: Any, device: Any) -> Any:
    """Device arrays committed to the runner's device. jit keys its cache on committedness, and a
    step's outputs come back committed when any input was or when its computation pins an output's
    memory kind (a stream-annotated call does; seventh session): feeding them back into a step
    compiled with uncommitted inputs would compile it again while serving. Committed params also
    put each step on that device (host inputs follow them)."""
    return jax.device_put(tree, device)


def _same_crops(crops: np.ndarray | CropPlan) -> bool:
    """Whether crops 0 and 1 are the same pixels (host crops) or the same resize (a plan's tables)."""
    if isinstance(crops, CropPlan):
        return all(np.array_equal(a[0], a[1]) for a in (crops.flip, crops.idx1, crops.w1, crops.idx2, crops.w2))
    return bool(np.array_equal(crops[0], crops[1]))


def pages_needed(tokens: int, page_size: int) -> int:
    return math.ceil(tokens / page_size)
