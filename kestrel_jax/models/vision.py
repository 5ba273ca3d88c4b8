"""Vision encoder: crops -> SigLIP-style ViT -> stitched local grid -> pooled -> projector.

MOONDREAM.md §5. Crop selection/resizing lives in `image_crops.py` (host, PIL); everything here
is jnp and jittable for a static tiling.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kestrel_jax.models.config import VisionConfig
from kestrel_jax.models.layers import MLP, LayerNorm, Linear, gelu_tanh
from kestrel_jax.pallas import ops


def normalize_crops(crops_u8: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """uint8 [n, S, S, 3] -> [n, S, S, 3] in [-1, 1]: (u/255 - 0.5)/0.5 evaluated in float32."""
    x = crops_u8.astype(jnp.float32) / 255.0
    return ((x - 0.5) / 0.5).astype(dtype)


def patchify(x: jax.Array, patch: int) -> jax.Array:
    """[n, S, S, C] -> [n, (S/p)^2, C*p*p]; patches row-major, vector order (channel, y, x)."""
    n, s, _, c = x.shape
    g = s // patch
    x = x.reshape(n, g, patch, g, patch, c)  # n, gy, py, gx, px, c
    x = x.transpose(0, 1, 3, 5, 2, 4)  # n, gy, gx, c, py, px
    return x.reshape(n, g * g, c * patch * patch)


class VisionAttention(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.qkv = Linear(cfg.enc_dim, 3 * cfg.enc_dim, dtype=dtype, rngs=rngs)
        self.proj = Linear(cfg.enc_dim, cfg.enc_dim, dtype=dtype, rngs=rngs)
        self.n_heads = cfg.enc_n_heads

    def __call__(self, x: jax.Array, impl: str | None = None) -> jax.Array:  # [n, T, E] -> [n, T, E]
        """`impl`: `jax.nn.dot_product_attention`'s implementation, None (XLA, portable) or
        "cudnn" (fused, NVIDIA GPUs; half precision only, else XLA is used)."""
        n, t, e = x.shape
        h = self.n_heads
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
        q, k, v = (a.reshape(n, t, h, e // h) for a in (q, k, v))
        # cuDNN's fused attention takes half precision only; scale 1/sqrt(head_dim), no mask
        fused = impl == "cudnn" and q.dtype in (jnp.bfloat16, jnp.float16)
        o = jax.nn.dot_product_attention(q, k, v, implementation="cudnn" if fused else None)
        return self.proj(o.reshape(n, t, e))


class VisionBlock(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.ln1 = LayerNorm(cfg.enc_dim, dtype=dtype)
        self.attn = VisionAttention(cfg, dtype=dtype, rngs=rngs)
        self.ln2 = LayerNorm(cfg.enc_dim, dtype=dtype)
        self.mlp = MLP(cfg.enc_dim, cfg.enc_ff_dim, cfg.enc_dim, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, attn_impl: str | None = None) -> jax.Array:
        """The block's expressions (MOONDREAM.md §5). `VisionEncoder.encode_crops` runs them with
        each residual add fused into the next LayerNorm's launch; tests compare the two."""
        x = x + self.attn(self.ln1(x), attn_impl)
        return x + self.mlp(self.ln2(x))


def _add_norm(x: jax.Array, adds: tuple[jax.Array, ...], ln: LayerNorm) -> tuple[jax.Array, jax.Array]:
    return ops.residual_layer_norm(x, adds, ln.scale[...], ln.bias[...], eps=ln.eps)


@functools.lru_cache(maxsize=64)
def stitch_indices(rows: int, cols: int, grid: int, margin: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gather indices building the stitched grid from tile features [rows*cols, g, g, E].

    Tile (i, j) keeps its inner rows margin..g-margin-1, plus the outer margin on image borders,
    placed at offset ((g - 2*margin) * i, ...). Returns (tile [Hg, Wg], row [Hg], col [Wg]).
    """
    step = grid - 2 * margin

    def axis(n: int) -> tuple[np.ndarray, np.ndarray]:
        size = step * n + 2 * margin
        tile = np.empty(size, np.int32)
        inner = np.empty(size, np.int32)
        for i in range(n):
            lo = 0 if i == 0 else margin
            hi = grid if i == n - 1 else grid - margin
            for r in range(lo, hi):
                tile[step * i + r] = i
                inner[step * i + r] = r
        return tile, inner

    ti, ri = axis(rows)
    tj, cj = axis(cols)
    return ti[:, None] * cols + tj[None, :], ri, cj


@functools.lru_cache(maxsize=64)
def adaptive_pool_matrix(n_in: int, n_out: int) -> np.ndarray:
    """PyTorch adaptive_avg_pool bins as a [n_out, n_in] averaging matrix (float32)."""
    m = np.zeros((n_out, n_in), np.float32)
    for a in range(n_out):
        start = (a * n_in) // n_out
        end = -((-(a + 1) * n_in) // n_out)  # ceil
        m[a, start:end] = 1.0 / (end - start)
    return m


def stitch(local: jax.Array, tiling: tuple[int, int], cfg: VisionConfig) -> jax.Array:
    """[rows*cols, g*g, E] -> stitched [(step*rows + 2m), (step*cols + 2m), E]."""
    rows, cols = tiling
    g = cfg.grid_size
    tiles = local.reshape(rows * cols, g, g, local.shape[-1])
    t, r, c = stitch_indices(rows, cols, g, cfg.overlap_margin)
    return tiles[t, r[:, None], c[None, :]]


def adaptive_pool(grid: jax.Array, out: int) -> jax.Array:
    """[Hg, Wg, E] -> [out*out, E] with PyTorch adaptive-average-pool bins, f32 accumulation."""
    hg, wg, _ = grid.shape
    ph = jnp.asarray(adaptive_pool_matrix(hg, out))
    pw = jnp.asarray(adaptive_pool_matrix(wg, out))
    pooled = jnp.einsum("ah,hwe,bw->abe", ph, grid.astype(jnp.float32), pw,
                        precision=jax.lax.Precision.HIGHEST)
    return pooled.reshape(out * out, -1).astype(grid.dtype)


def tile_pool_matrices(tiling: tuple[int, int], cfg: VisionConfig, n_tiles: int) -> tuple[np.ndarray, np.ndarray]:
    """Stitch + adaptive pooling as per-tile separable weights, for a fixed-shape encoder step.

    pooled[a, b] = sum_t sum_{r, c} rows[t, a, r] * tiles[t, r, c] * cols[t, b, c], where rows[t]
    holds the pooling weight of every grid row that tile t contributes (through its in-tile row
    r) and zeros for rows it does not own. Tiles beyond rows*cols (padding up to `n_tiles`) get
    zero weights. Returns (rows, cols), each [n_tiles, g, g] float32.
    """
    r_n, c_n = tiling
    g = cfg.grid_size
    t_idx, r_idx, c_idx = stitch_indices(r_n, c_n, g, cfg.overlap_margin)
    ph = adaptive_pool_matrix(len(r_idx), g)  # [g, Hg]
    pw = adaptive_pool_matrix(len(c_idx), g)  # [g, Wg]
    rows = np.zeros((n_tiles, g, g), np.float32)
    cols = np.zeros((n_tiles, g, g), np.float32)
    tile_row = t_idx[:, 0] // c_n  # grid row y -> tile row i
    tile_col = t_idx[0, :] % c_n  # grid col x -> tile col j
    for i in range(r_n):
        for j in range(c_n):
            t = i * c_n + j
            ys = np.nonzero(tile_row == i)[0]
            xs = np.nonzero(tile_col == j)[0]
            rows[t][:, r_idx[ys]] = ph[:, ys]
            cols[t][:, c_idx[xs]] = pw[:, xs]
    return rows, cols


class ProjectorMLP(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.fc1 = Linear(2 * cfg.enc_dim, cfg.proj_inner_dim, dtype=dtype, rngs=rngs)
        self.fc2 = Linear(cfg.proj_inner_dim, cfg.proj_out_dim, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(gelu_tanh(self.fc1(x)))


class VisionEncoder(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.patch_emb = Linear(cfg.patch_dim, cfg.enc_dim, dtype=dtype, rngs=rngs)
        self.pos_emb = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (1, cfg.n_patches,
                                                                              cfg.enc_dim), dtype))
        self.blocks = nnx.List([VisionBlock(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.enc_n_layers)])
        self.post_ln = LayerNorm(cfg.enc_dim, dtype=dtype)
        self.proj_mlp = ProjectorMLP(cfg, dtype=dtype, rngs=rngs)

    def encode_crops(self, crops_u8: jax.Array, dtype: jnp.dtype, attn_impl: str | None = None) -> jax.Array:
        """uint8 [n, S, S, 3] -> features [n, g*g, E] (after post_ln)."""
        x = patchify(normalize_crops(crops_u8, dtype), self.cfg.enc_patch_size)
        x = self.patch_emb(x) + self.pos_emb[...].astype(dtype)
        # `VisionBlock.__call__`'s expressions, with each residual add and the LayerNorm after it
        # in one `ops.residual_layer_norm` (one launch on a GPU where XLA takes two)
        lns = [ln for block in self.blocks for ln in (block.ln1, block.ln2)] + [self.post_ln]
        _, h = _add_norm(x, (), lns[0])
        for i, block in enumerate(self.blocks):
            x, h = _add_norm(x, (block.attn(h, attn_impl),), lns[2 * i + 1])
            x, h = _add_norm(x, (block.mlp(h),), lns[2 * i + 2])
        return h

    def project(self, features: jax.Array, tiling: tuple[int, int]) -> tuple[jax.Array, jax.Array, jax.Array]:
        """features [n, g*g, E] -> (image tokens [g*g, D], stitched grid, pooled [g*g, E])."""
        grid = stitch(features[1:], tiling, self.cfg)
        pooled = adaptive_pool(grid, self.cfg.grid_size)
        x = jnp.concatenate([features[0], pooled], axis=-1)
        return self.proj_mlp(x), grid, pooled

    def encode_padded(self, crops_u8: jax.Array, pool_rows: jax.Array, pool_cols: jax.Array,
                      dtype: jnp.dtype, attn_impl: str | None = None) -> jax.Array:
        """Fixed-shape image encoding for the engine: crops [n, S, S, 3] (global first, then
        tiles, zero-padded to a bucket) with `tile_pool_matrices` weights [n-1, g, g] ->
        image tokens [g*g, D]. Equals `__call__` for the real crops. With n = 1 (a 1x1 tiling,
        whose tile is the global crop's pixels) the global crop's features are also the tile's
        (weights [1, g, g])."""
        feats = self.encode_crops(crops_u8, dtype, attn_impl)
        local = feats[1:] if feats.shape[0] > 1 else feats
        return self._pool_and_project(feats[0], local, pool_rows, pool_cols)

    def encode_singles(self, crops_u8: jax.Array, pool_rows: jax.Array, pool_cols: jax.Array,
                       dtype: jnp.dtype, attn_impl: str | None = None) -> jax.Array:
        """Several one-crop images at once: crops [G, S, S, 3], one per image (each a global crop
        that is also its image's only tile), with the one-tile pooling weights every such image
        shares ([1, g, g] each) -> image tokens [G, g*g, D]. Image i's tokens are
        `encode_padded(crops[i:i + 1], ...)`'s, up to GEMM rounding: the encoder's GEMMs run over
        G * g*g rows instead of g*g, which keeps more of a large GPU busy."""
        feats = self.encode_crops(crops_u8, dtype, attn_impl)
        return self._pool_and_project(feats, feats[:, None], pool_rows, pool_cols)

    def _pool_and_project(self, global_feats: jax.Array, local: jax.Array, pool_rows: jax.Array,
                          pool_cols: jax.Array) -> jax.Array:
        """Global crop features [..., g*g, E] and tile features [..., t, g*g, E] (leading image
        axes alike), tile pooling weights [t, g, g] -> image tokens [..., g*g, D]."""
        g = self.cfg.grid_size
        tiles = local.reshape(*local.shape[:-2], g, g, local.shape[-1]).astype(jnp.float32)
        pooled = jnp.einsum("tar,...trce,tbc->...abe", pool_rows, tiles, pool_cols,
                            precision=jax.lax.Precision.HIGHEST)
        pooled = pooled.reshape(*pooled.shape[:-3], g * g, -1).astype(global_feats.dtype)
        return self.proj_mlp(jnp.concatenate([global_feats, pooled], axis=-1))

    def __call__(self, crops_u8: jax.Array, tiling: tuple[int, int], dtype: jnp.dtype) -> jax.Array:
        """uint8 crops [1 + rows*cols, S, S, 3] -> image tokens [g*g, D]."""
        return self.project(self.encode_crops(crops_u8, dtype), tiling)[0]
