"""The runner: owns the device state (params, KV pool) and the jitted fixed-shape steps.

Steps (each compiled once per bucket at start-up; a guard fails loudly on any later recompile):
  - vision: crops [n_bucket, 378, 378, 3] u8 -> features (per crop-count bucket), then the
    stitch/pool/projector per tiling -> image tokens [729, D];
  - prefill: a ragged batch of prompt chunks (T-token bucket, B sequences) -> per sequence the
    outputs of its last row (when its prompt completes);
  - decode: one position per row (B bucket).
Each step ends in the same `StepOutputs`: the sampled token per row (each row's own sampling
settings and constraints), plus what the region skills need from that row's hidden state: the
decoded coordinate, the decoded size, and the detect/point continuation decision. Region heads
run only when some row needs them (`lax.cond`), since MD2's are 50 MB MLPs.

Row inputs are a token id, a coordinate value, a size pair or (prefill) an image-token row:
the embedding is selected inside the step, so one compiled step serves every skill.
The KV pool (`KVCache`) is donated to every step and updated in place.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kestrel_jax.models.moondream import MoondreamModel
from kestrel_jax.models.region import coord_bin_to_value, size_bin_to_value
from kestrel_jax.models.text import AttentionBatch, KVCache
from kestrel_jax.models.vision import tile_pool_matrices
from kestrel_jax.pallas import ops
from kestrel_jax.pallas.paged_attention import init_kv_pool
from kestrel_jax.pallas.sampling import SamplingParams, sample

log = logging.getLogger(__name__)

# Row input kinds.
IN_TOKEN, IN_COORD, IN_SIZE, IN_IMAGE = 0, 1, 2, 3
VISION_CROP_BUCKETS = (2, 5, 7, 10, 13)


class RecompileError(RuntimeError):
    """A jitted step was traced again while serving: some input shape escaped its bucket."""


@dataclass(frozen=True)
class RunnerConfig:
    page_size: int = 64
    num_pages: int | None = None  # None: sized from the device's free memory
    kv_memory_fraction: float = 0.85  # of the memory free after params, when num_pages is None
    kv_dtype: str = "auto"  # "bf16" | "fp8" | "f32" | "auto" (fp8 on GPU when the checkpoint has KV scales)
    max_seq_len: int | None = None  # default: the model's context
    max_pages_per_seq: int | None = None  # default: ceil(max_seq_len / page_size)
    backend: str = "auto"  # kernel backend for attention / MoE / sampling
    vision_buckets: tuple[int, ...] = VISION_CROP_BUCKETS  # crop counts (global + tiles) compiled
    compilation_cache_dir: str | None = None


class StepOutputs(NamedTuple):
    tokens: jax.Array  # [B] i32 sampled token
    logprobs: jax.Array  # [B] f32
    coord: jax.Array  # [B] f32 coordinate decoded from the row's hidden state (region rows)
    size: jax.Array  # [B, 2] f32 (width, height) decoded likewise
    region_next: jax.Array  # [B] i32 detect/point continuation: coord_id or eos_id


Arr = jax.Array | np.ndarray  # host arrays in, device arrays inside the step


class RowInputs(NamedTuple):
    kind: Arr  # [N] i32 IN_TOKEN / IN_COORD / IN_SIZE / IN_IMAGE
    token: Arr  # [N] i32
    value: Arr  # [N, 2] f32 coordinate (x in [:, 0]) or size (w, h)
    image_row: Arr  # [N] i32 row into the flattened image-token block, -1 = none


class RowFlags(NamedTuple):
    region: Arr  # [B] bool: detect/point rows (always want region outputs)
    reasoning: Arr  # [B] bool: rows whose sampled coord_id must be decoded to a value


def _embed(model: MoondreamModel, rows: RowInputs, images: jax.Array | None) -> jax.Array:
    dtype = model.dtype
    x = model.text.embed(jnp.clip(rows.token, 0, model.cfg.text.vocab_size - 1), dtype)
    value = jnp.asarray(rows.value)
    coord = model.region.encode_coordinate(value[:, :1], dtype)
    size = model.region.encode_size(value, dtype)
    x = jnp.where((rows.kind == IN_COORD)[:, None], coord, x)
    x = jnp.where((rows.kind == IN_SIZE)[:, None], size, x)
    if images is not None:
        flat = images.reshape(-1, images.shape[-1]).astype(dtype)
        img = flat[jnp.clip(rows.image_row, 0, flat.shape[0] - 1)]
        x = jnp.where((rows.kind == IN_IMAGE)[:, None], img, x)
    return x


def _heads(model: MoondreamModel, hidden: jax.Array, sp: SamplingParams, flags: RowFlags,
           backend: str) -> StepOutputs:
    """hidden [B, D] (pre post_ln) -> sampled tokens + region outputs."""
    tk = model.cfg.tokenizer
    logits = model.text.logits(hidden)  # [B, V] f32
    out = sample(logits, sp, return_logprobs=True, backend=backend)  # type: ignore[arg-type]
    if model.cfg.is_md3:
        nxt = jnp.where(logits[:, tk.coord_id] >= logits[:, tk.eos_id], tk.coord_id, tk.eos_id)
    else:
        nxt = jnp.argmax(logits, axis=-1)
    need = flags.region | (flags.reasoning & (out.tokens == tk.coord_id))
    b = hidden.shape[0]

    def region_outputs(h: jax.Array) -> tuple[jax.Array, jax.Array]:
        c = coord_bin_to_value(jnp.argmax(model.region.decode_coordinate(h), axis=-1))
        s = size_bin_to_value(jnp.argmax(model.region.decode_size(h), axis=-1))
        return c, s

    coord, size = jax.lax.cond(jnp.any(need), region_outputs,
                               lambda h: (jnp.zeros((b,), jnp.float32), jnp.zeros((b, 2), jnp.float32)), hidden)
    assert out.logprobs is not None
    return StepOutputs(out.tokens, out.logprobs, coord, size, nxt.astype(jnp.int32))


def _copy_pages(cache: KVCache, copies: jax.Array) -> KVCache:
    """Whole-page copies (all layers, K and V) src -> dst; rows with dst < 0 are skipped."""
    src = jnp.clip(copies[:, 0], 0, cache.num_pages - 1)
    dst = jnp.where(copies[:, 1] < 0, cache.num_pages, copies[:, 1])  # out of range -> dropped
    k = tuple(kp.at[dst].set(kp[src], mode="drop") for kp in cache.k)
    v = tuple(vp.at[dst].set(vp[src], mode="drop") for vp in cache.v)
    return KVCache(k, v, cache.k_scale, cache.v_scale)


def _merge(graphdef: Any, treedef: Any, params: list[jax.Array]) -> MoondreamModel:
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, params))


def _decode_step(graphdef: Any, treedef: Any, params: list[jax.Array], cache: KVCache, rows: RowInputs,
                 positions: jax.Array, slots: jax.Array, kv_lens: jax.Array, page_table: jax.Array, copies: jax.Array,
                 sp: SamplingParams, flags: RowFlags, backend: str) -> tuple[KVCache, StepOutputs]:
    model = _merge(graphdef, treedef, params)
    with ops.use_backend(backend):  # type: ignore[arg-type]
        cache = _copy_pages(cache, copies)
        x = _embed(model, rows, None)
        batch = AttentionBatch(positions, slots, kv_lens, page_table)
        hidden, cache, _ = model.text(x, batch, cache)
        return cache, _heads(model, hidden, sp, flags, backend)


def _prefill_step(graphdef: Any, treedef: Any, params: list[jax.Array], cache: KVCache, rows: RowInputs,
                  images: jax.Array,
                  positions: jax.Array, slots: jax.Array, cu_q_lens: jax.Array, kv_lens: jax.Array,
                  page_table: jax.Array, prefix_lens: jax.Array, logits_rows: jax.Array, copies: jax.Array,
                  sp: SamplingParams, flags: RowFlags, backend: str) -> tuple[KVCache, StepOutputs]:
    model = _merge(graphdef, treedef, params)
    with ops.use_backend(backend):  # type: ignore[arg-type]
        cache = _copy_pages(cache, copies)
        x = _embed(model, rows, images)
        batch = AttentionBatch(positions, slots, kv_lens, page_table, cu_q_lens, prefix_lens)
        hidden, cache, _ = model.text(x, batch, cache)
        last = hidden[jnp.clip(logits_rows, 0, hidden.shape[0] - 1)]  # [B, D]
        return cache, _heads(model, last, sp, flags, backend)


def _vision_step(graphdef: Any, treedef: Any, params: list[jax.Array], crops: jax.Array,
                 pool_rows: jax.Array, pool_cols: jax.Array) -> jax.Array:
    model = _merge(graphdef, treedef, params)
    return model.vision.encode_padded(crops, pool_rows, pool_cols, model.dtype)


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

    def __init__(self, model: MoondreamModel, config: RunnerConfig | None = None):
        self.config = config or RunnerConfig()
        if self.config.compilation_cache_dir:
            os.makedirs(self.config.compilation_cache_dir, exist_ok=True)
            jax.config.update("jax_compilation_cache_dir", self.config.compilation_cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        self.model = model
        self.cfg = model.cfg
        t = self.cfg.text
        self.max_seq_len = self.config.max_seq_len or t.max_context
        self.page_size = self.config.page_size
        self.max_pages_per_seq = self.config.max_pages_per_seq or -(-self.max_seq_len // self.page_size)
        self.kv_dtype = _kv_dtype(self.config.kv_dtype, model)
        self.vision_buckets = tuple(sorted(self.config.vision_buckets))
        # Params travel as one flat list: dispatching a flat list of arrays is much cheaper per
        # step than flattening the nested module state on every call.
        self.graphdef, state = nnx.split(model)
        self.params, self.treedef = jax.tree.flatten(state)
        self.num_pages = self.config.num_pages or self._pages_from_memory()
        pool = init_kv_pool(t.n_layers, self.num_pages, self.page_size, t.n_kv_heads, t.head_dim, self.kv_dtype)
        scales = jnp.asarray(model.text.kv_scales[...], jnp.float32)
        self.cache = KVCache(tuple(k for k, _ in pool), tuple(v for _, v in pool), scales[:, 0], scales[:, 1])
        backend = self.config.backend
        self._decode = jax.jit(functools.partial(_decode_step, self.graphdef, self.treedef, backend=backend),
                               donate_argnums=(1,))
        self._prefill = jax.jit(functools.partial(_prefill_step, self.graphdef, self.treedef, backend=backend),
                                donate_argnums=(1,))
        self._vision = jax.jit(functools.partial(_vision_step, self.graphdef, self.treedef))
        self._frozen: dict[str, int] | None = None

    # ------------------------------------------------------------------------------- sizing
    def kv_bytes_per_page(self) -> int:
        t = self.cfg.text
        return 2 * t.n_layers * t.n_kv_heads * t.head_dim * self.page_size * jnp.dtype(self.kv_dtype).itemsize

    def _pages_from_memory(self) -> int:
        dev = jax.devices()[0]
        stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
        need = self.max_pages_per_seq * 8  # a floor: room for 8 full-length sequences
        if not stats or "bytes_limit" not in stats:
            return need  # CPU: no budget to size against
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        pages = int(free * self.config.kv_memory_fraction) // self.kv_bytes_per_page()
        if pages < self.max_pages_per_seq:
            raise MemoryError(f"only {pages} KV pages fit in free device memory; a single "
                              f"{self.max_seq_len}-token sequence needs {self.max_pages_per_seq}")
        return pages

    # ------------------------------------------------------------------------------- vision
    def encode_image(self, crops_u8: np.ndarray, tiling: tuple[int, int]) -> jax.Array:
        """uint8 crops [n, S, S, 3] -> image tokens [729, D] on the device (one fixed-shape step
        per crop-count bucket; the tiling enters as pooling weights, not as a shape)."""
        n = crops_u8.shape[0]
        bucket = next((b for b in self.vision_buckets if b >= n), None)
        if bucket is None:
            # The reference's tiling rule allows more than 13 crops for extreme aspect ratios.
            raise ValueError(f"an image of {n} crops exceeds the largest vision bucket "
                             f"({self.vision_buckets[-1]}); extend RunnerConfig.vision_buckets")
        pad = np.zeros((bucket - n, *crops_u8.shape[1:]), np.uint8)
        rows, cols = tile_pool_matrices(tiling, self.cfg.vision, bucket - 1)
        return self._guarded("vision", self._vision, self.params, jnp.asarray(np.concatenate([crops_u8, pad])),
                             rows, cols)

    # ------------------------------------------------------------------------------- steps
    def decode(self, rows: RowInputs, positions: np.ndarray, slots: np.ndarray, kv_lens: np.ndarray,
               page_table: np.ndarray, copies: np.ndarray, sp: SamplingParams, flags: RowFlags) -> StepOutputs:
        self.cache, out = self._guarded("decode", self._decode, self.params, self.cache, rows,
                                        positions, slots, kv_lens, page_table, copies, sp, flags)
        return out

    def prefill(self, rows: RowInputs, images: jax.Array, positions: np.ndarray, slots: np.ndarray,
                cu_q_lens: np.ndarray, kv_lens: np.ndarray, page_table: np.ndarray, prefix_lens: np.ndarray,
                logits_rows: np.ndarray, copies: np.ndarray, sp: SamplingParams, flags: RowFlags) -> StepOutputs:
        self.cache, out = self._guarded("prefill", self._prefill, self.params, self.cache, rows,
                                        images, positions, slots, cu_q_lens, kv_lens, page_table, prefix_lens,
                                        logits_rows, copies, sp, flags)
        return out

    def recover(self) -> bool:
        """After a failed step: if the donated KV pool was consumed, allocate a fresh one.
        Returns True when the KV contents were lost (every live sequence must be failed)."""
        if not any(a.is_deleted() for a in (*self.cache.k, *self.cache.v)):
            return False
        t = self.cfg.text
        pool = init_kv_pool(t.n_layers, self.num_pages, self.page_size, t.n_kv_heads, t.head_dim, self.kv_dtype)
        self.cache = KVCache(tuple(k for k, _ in pool), tuple(v for _, v in pool), self.cache.k_scale,
                             self.cache.v_scale)
        return True

    # ------------------------------------------------------------------------------- guard
    def _fns(self) -> dict[str, Any]:
        return {"decode": self._decode, "prefill": self._prefill, "vision": self._vision}

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


def sampling_arrays(b: int, n_allowed: int = 2, n_suppressed: int = 2) -> dict[str, np.ndarray]:
    """Fresh host arrays for a SamplingParams batch of b rows (greedy, unconstrained)."""
    return {
        "temperature": np.zeros(b, np.float32), "top_k": np.zeros(b, np.int32), "top_p": np.ones(b, np.float32),
        "seed": np.zeros(b, np.uint32), "step": np.zeros(b, np.int32),
        "allowed_ids": np.full((b, n_allowed), -1, np.int32),
        "suppressed_ids": np.full((b, n_suppressed), -1, np.int32),
    }


def pages_needed(tokens: int, page_size: int) -> int:
    return math.ceil(tokens / page_size)
