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
from kestrel_jax.serving import batch as bt

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
    # Of the memory free after params, when num_pages is None. The rest stays for the steps'
    # temporaries (a 2048-token prefill of MD3 needs a few GiB).
    kv_memory_fraction: float = 0.6
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

    def packed(self) -> jax.Array:
        """[B, 6] f32 (token ids are exact in f32 below 2^24): one device->host copy per step
        instead of five."""
        return jnp.stack([self.tokens.astype(jnp.float32), self.logprobs, self.coord, self.size[:, 0],
                          self.size[:, 1], self.region_next.astype(jnp.float32)], axis=1)


def unpack(host: np.ndarray) -> StepOutputs:
    """Inverse of `StepOutputs.packed` on the host ([B, 6] numpy)."""
    return StepOutputs(host[:, 0].astype(np.int32), host[:, 1], host[:, 2], host[:, 3:5],  # type: ignore[arg-type]
                       host[:, 5].astype(np.int32))  # type: ignore[arg-type]


def _embed(model: MoondreamModel, kind: jax.Array, token: jax.Array, value: jax.Array,
           image_row: jax.Array | None, images: jax.Array | None) -> jax.Array:
    """Per-row input embedding: wte[token], E_coord(value[0]), E_size(value) or an image row."""
    dtype = model.dtype
    x = model.text.embed(jnp.clip(token, 0, model.cfg.text.vocab_size - 1), dtype)
    coord = model.region.encode_coordinate(value[:, :1], dtype)
    size = model.region.encode_size(value, dtype)
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


def _heads(model: MoondreamModel, hidden: jax.Array, sp: SamplingParams, region: jax.Array,
           reasoning: jax.Array, backend: str, out_rows: int) -> jax.Array:
    """hidden [B, D] (pre post_ln) -> packed outputs [out_rows, 6] (see StepOutputs.packed)."""
    tk = model.cfg.tokenizer
    logits = model.text.logits(hidden)  # [B, V] f32
    out = sample(logits, sp, return_logprobs=True, backend=backend)  # type: ignore[arg-type]
    if model.cfg.is_md3:
        nxt = jnp.where(logits[:, tk.coord_id] >= logits[:, tk.eos_id], tk.coord_id, tk.eos_id)
    else:
        nxt = jnp.argmax(logits, axis=-1)
    need = region | (reasoning & (out.tokens == tk.coord_id))
    b = hidden.shape[0]

    def region_outputs(h: jax.Array) -> tuple[jax.Array, jax.Array]:
        c = coord_bin_to_value(jnp.argmax(model.region.decode_coordinate(h), axis=-1))
        s = size_bin_to_value(jnp.argmax(model.region.decode_size(h), axis=-1))
        return c, s

    coord, size = jax.lax.cond(jnp.any(need), region_outputs,
                               lambda h: (jnp.zeros((b,), jnp.float32), jnp.zeros((b, 2), jnp.float32)), hidden)
    assert out.logprobs is not None
    packed = StepOutputs(out.tokens, out.logprobs, coord, size, nxt.astype(jnp.int32)).packed()
    return jnp.pad(packed, ((0, out_rows - b), (0, 0)))


def _copy_pages(cache: KVCache, copies: jax.Array) -> KVCache:
    """Whole-page copies (all layers, K and V) src -> dst; rows with dst < 0 are skipped."""
    src = jnp.clip(copies[:, 0], 0, cache.num_pages - 1)
    dst = jnp.where(copies[:, 1] < 0, cache.num_pages, copies[:, 1])  # out of range -> dropped
    k = tuple(kp.at[dst].set(kp[src], mode="drop") for kp in cache.k)
    v = tuple(vp.at[dst].set(vp[src], mode="drop") for vp in cache.v)
    return KVCache(k, v, cache.k_scale, cache.v_scale)


def _merge(graphdef: Any, treedef: Any, params: list[jax.Array]) -> MoondreamModel:
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, params))


def _decode_step(graphdef: Any, treedef: Any, params: list[jax.Array], cache: KVCache, ints: jax.Array,
                 floats: jax.Array, prev: jax.Array, backend: str, out_rows: int) -> tuple[KVCache, jax.Array]:
    """ints [B, DI + P], floats [B, DF] (batch.py layout), prev [out_rows, 6] the previous step's
    packed outputs (rows with src >= 0 take their input from it)."""
    model = _merge(graphdef, treedef, params)
    tk = model.cfg.tokenizer
    with ops.use_backend(backend):  # type: ignore[arg-type]
        src = ints[:, bt.D_SRC]
        use_prev = src >= 0
        p = prev[jnp.clip(src, 0, prev.shape[0] - 1)]
        p_tok = p[:, 0].astype(jnp.int32)
        reasoning = (ints[:, bt.D_FLAGS] & bt.FLAG_REASONING) != 0
        region = (ints[:, bt.D_FLAGS] & bt.FLAG_REGION) != 0
        kind = ints[:, bt.D_KIND]
        token = jnp.where(use_prev, p_tok, ints[:, bt.D_TOKEN])
        value = floats[:, bt.F_VAL0: bt.F_VAL1 + 1]
        p_coord = jnp.stack([p[:, 2], jnp.zeros_like(p[:, 2])], axis=1)
        # a reasoning row that sampled the coordinate token feeds E_coord(its decoded value)
        r_coord = use_prev & reasoning & (p_tok == tk.coord_id)
        kind = jnp.where(r_coord, IN_COORD, kind)
        value = jnp.where((use_prev & (kind == IN_COORD))[:, None], p_coord, value)
        value = jnp.where((use_prev & (kind == IN_SIZE))[:, None], p[:, 3:5], value)
        # a reasoning row that sampled the answer token feeds it and starts its answer: the next
        # sample is the answer's first, with nothing suppressed
        first_answer = use_prev & reasoning & (p_tok == tk.answer_id)
        sup = jnp.where(first_answer[:, None], -1, ints[:, bt.D_SUP: bt.D_SUP + bt.N_SUP])
        reasoning = reasoning & ~first_answer
        x = _embed(model, kind, token, value, None, None)
        batch = AttentionBatch(ints[:, bt.D_POS], ints[:, bt.D_SLOT], ints[:, bt.D_KV_LEN], ints[:, bt.DI:],
                               num_valid=ints[0, bt.D_NUM_VALID])
        hidden, cache, _ = model.text(x, batch, cache)
        sp = _sampling(ints, floats, bt.D_TOP_K, bt.D_SEED, bt.D_STEP, bt.D_SUP, bt.F_TEMP, bt.F_TOP_P, sup)
        return cache, _heads(model, hidden, sp, region, reasoning, backend, out_rows)


def _prefill_step(graphdef: Any, treedef: Any, params: list[jax.Array], cache: KVCache, tok_ints: jax.Array,
                  tok_floats: jax.Array, seq_ints: jax.Array, seq_floats: jax.Array, images: jax.Array,
                  backend: str, out_rows: int) -> tuple[KVCache, jax.Array]:
    """tok_ints [T, TI], tok_floats [T, 2], seq_ints [B, SI + P], seq_floats [B, 2] (batch.py
    layout), images [NI, 729, D]: per-sequence outputs of each completed prompt's last row."""
    model = _merge(graphdef, treedef, params)
    with ops.use_backend(backend):  # type: ignore[arg-type]
        x = _embed(model, tok_ints[:, bt.T_KIND], tok_ints[:, bt.T_TOKEN], tok_floats, tok_ints[:, bt.T_IMG_ROW],
                   images)
        cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), seq_ints[:, bt.S_CU_END]])
        batch = AttentionBatch(tok_ints[:, bt.T_POS], tok_ints[:, bt.T_SLOT], seq_ints[:, bt.S_KV_LEN],
                               seq_ints[:, bt.SI:], cu, seq_ints[:, bt.S_PREFIX], tok_ints[0, bt.T_NUM_VALID])
        hidden, cache, _ = model.text(x, batch, cache)
        last = hidden[jnp.clip(seq_ints[:, bt.S_LOGITS_ROW], 0, hidden.shape[0] - 1)]  # [B, D]
        flags = seq_ints[:, bt.S_FLAGS]
        sp = _sampling(seq_ints, seq_floats, bt.S_TOP_K, bt.S_SEED, bt.S_STEP, bt.S_SUP, 0, 1)
        return cache, _heads(model, last, sp, (flags & bt.FLAG_REGION) != 0, (flags & bt.FLAG_REASONING) != 0,
                             backend, out_rows)


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
        self._decode = jax.jit(functools.partial(_decode_step, self.graphdef, self.treedef, backend=backend,
                                                 out_rows=out_rows), donate_argnums=(1,))
        self._prefill = jax.jit(functools.partial(_prefill_step, self.graphdef, self.treedef, backend=backend,
                                                  out_rows=out_rows), donate_argnums=(1,))
        self._copy = jax.jit(_copy_pages, donate_argnums=(0,))
        self.no_outputs = jnp.zeros((out_rows, 6), jnp.float32)
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
    def decode(self, ints: np.ndarray, floats: np.ndarray, prev: jax.Array | None) -> jax.Array:
        """Dispatch a decode step (batch.py layout); returns its packed outputs [out_rows, 6]
        without waiting. `prev`: the previous step's packed outputs (for rows with src >= 0)."""
        prev = self.no_outputs if prev is None else prev
        self.cache, out = self._guarded("decode", self._decode, self.params, self.cache, ints, floats, prev)
        return out

    def prefill(self, tok_ints: np.ndarray, tok_floats: np.ndarray, seq_ints: np.ndarray, seq_floats: np.ndarray,
                images: jax.Array) -> jax.Array:
        self.cache, out = self._guarded("prefill", self._prefill, self.params, self.cache, tok_ints, tok_floats,
                                        seq_ints, seq_floats, images)
        return out

    def copy_pages(self, copies: np.ndarray) -> None:
        """Whole-page KV copies [C, 2] (src, dst), dispatched before the step that needs them."""
        self.cache = self._guarded("copy", self._copy, self.cache, copies)

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
        return {"decode": self._decode, "prefill": self._prefill, "vision": self._vision, "copy": self._copy}

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


def pages_needed(tokens: int, page_size: int) -> int:
    return math.ceil(tokens / page_size)
