"""MD3 tau dots for prefill and batched decode: s_q = GELU_erf(u) . wq[h], s_v = GELU_erf(u) . wv[h].

The tau scaling (MOONDREAM.md §3.3.2, `qkv_epilogue`) reads the whole fused QKV row u
([T, N], N = 6144 for MD3) through an exact-erf GELU and two small products with wq, wv ([H, N],
H = 32). In XLA that is an elementwise GELU pass writing g = GELU(u) back to memory and a split-K
GEMM reading it again. On the H100 at a 2048-token prefill the GELU pass alone took 39.7 us per
layer (f32 erf over 12.6 M values) and the GEMM 10.8 us, ~1.2 ms of a 14.9 ms step over 24 layers
(eleventh session, tools/probe_step_kernels.py). Decode batches above the fused decode epilogue's
`MAX_TAU_ROWS` paid the same two passes (3.3 + 2.4 us per layer at 64 rows).

`tau_dots_kernel` is one Pallas Triton launch: program (i, s) takes `block_rows` rows of u and the
s-th of `splits` column ranges, forms GELU in float32 with the Abramowitz-Stegun erf
(`moe.gelu_erf_poly`, |error| <= 1.5e-7), rounds it to u's dtype as the jnp path holds it, and
accumulates both products on the tensor cores in float32. g never goes to memory. Each split
writes float32 partial sums; the caller's tau fusion adds the splits (XLA folds that sum into the
tanh it applies next) and rounds to u's dtype, where the jnp path's product is rounded.

`tau_dots_ref` is the jnp path (the model's everywhere the kernel does not run).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kestrel_jax.models.layers import gelu_erf
from kestrel_jax.pallas.moe import gelu_erf_poly


class TauDotsConfig(NamedTuple):
    block_rows: int = 32  # rows of u per program (a power of two >= 16: a tensor-core tile)
    splits: int = 4  # column ranges of u per row block (more programs; partial sums added by XLA)
    block_cols: int = 256  # columns per loop iteration
    num_warps: int = 4
    num_stages: int = 2


def default_config(rows: int) -> TauDotsConfig:
    """H100, eleventh session (tools/bench_tau_dots.py): see BENCHMARKS.md."""
    if rows <= 64:
        return TauDotsConfig(block_rows=16, splits=8)
    return TauDotsConfig()


def tau_dots_ref(u: jax.Array, wq: jax.Array, wv: jax.Array) -> tuple[jax.Array, jax.Array]:
    """u [T, N], wq / wv [H, N] -> (GELU(u) @ wq.T, GELU(u) @ wv.T), both [T, H] in u.dtype."""
    g = gelu_erf(u)
    return jnp.dot(g, wq.astype(u.dtype).T), jnp.dot(g, wv.astype(u.dtype).T)


def _cols(n: int, cfg: TauDotsConfig) -> int:
    """Columns per iteration: the largest power of two <= block_cols dividing a split's range."""
    span = n // cfg.splits
    c = cfg.block_cols
    while c > 16 and span % c:
        c //= 2
    return c


def tau_dots_problem(u: jax.Array, wq: jax.Array, wv: jax.Array, config: TauDotsConfig | None = None) -> str | None:
    """Why `tau_dots_kernel` cannot take these shapes (None: it can)."""
    cfg = config or default_config(u.shape[0] if u.ndim == 2 else 0)
    if u.ndim != 2 or wq.ndim != 2 or wq.shape != wv.shape or wq.shape[1] != u.shape[1]:
        return f"need u [T, N] and wq, wv [H, N]; got {u.shape}, {wq.shape}, {wv.shape}"
    if jnp.dtype(u.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return f"u must be bf16 or f32, got {u.dtype}"
    h, n = wq.shape
    if h < 16 or h & (h - 1):
        return f"H = {h} heads: the products' tile needs a power of two >= 16"
    br = cfg.block_rows
    if br < 16 or br & (br - 1) or cfg.splits < 1:
        return f"block_rows {br} must be a power of two >= 16 and splits {cfg.splits} >= 1"
    if n % cfg.splits or (n // cfg.splits) % _cols(n, cfg):
        return f"N = {n} does not split into {cfg.splits} ranges of a multiple of 16 columns"
    return None


_NT = (((1,), (1,)), ((), ()))  # [rows, cols] x [H, cols] -> [rows, H]


def _kernel(u_ref, wq_ref, wv_ref, oq_ref, ov_ref, *, block_rows: int, cols: int, span: int):
    i, s = pl.program_id(0), pl.program_id(1)
    r0 = pl.multiple_of(i * block_rows, block_rows)
    c_base = s * span
    h = wq_ref.shape[0]
    dt = u_ref.dtype

    def body(j, acc):
        acc_q, acc_v = acc
        c0 = pl.multiple_of(c_base + j * cols, cols)
        u = u_ref[pl.ds(r0, block_rows), pl.ds(c0, cols)]
        g = gelu_erf_poly(u.astype(jnp.float32)).astype(dt)  # held in u's dtype, as the jnp path does
        wq = wq_ref[:, pl.ds(c0, cols)].astype(dt)
        wv = wv_ref[:, pl.ds(c0, cols)].astype(dt)
        acc_q += lax.dot_general(g, wq, _NT, preferred_element_type=jnp.float32)
        acc_v += lax.dot_general(g, wv, _NT, preferred_element_type=jnp.float32)
        return acc_q, acc_v

    zero = jnp.zeros((block_rows, h), jnp.float32)
    acc_q, acc_v = lax.fori_loop(0, span // cols, body, (zero, zero))
    oq_ref[s, pl.ds(r0, block_rows), :] = acc_q
    ov_ref[s, pl.ds(r0, block_rows), :] = acc_v


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def tau_dots_partials(u: jax.Array, wq: jax.Array, wv: jax.Array, *, config: TauDotsConfig | None = None,
                      interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """-> float32 partial sums [splits, T, H] of GELU(u) @ wq.T and of GELU(u) @ wv.T."""
    t, n = u.shape
    cfg = config or default_config(t)
    problem = tau_dots_problem(u, wq, wv, cfg)
    if problem is not None:
        raise ValueError(f"tau_dots_kernel: {problem}")
    h = wq.shape[0]
    br = cfg.block_rows
    rows = -(-t // br) * br
    up = u if rows == t else jnp.pad(u, ((0, rows - t), (0, 0)))
    span = n // cfg.splits
    kernel = functools.partial(_kernel, block_rows=br, cols=_cols(n, cfg), span=span)
    out = jax.ShapeDtypeStruct((cfg.splits, rows, h), jnp.float32)
    oq, ov = pl.pallas_call(
        kernel,
        grid=(rows // br, cfg.splits),
        out_shape=(out, out),
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="kestrel_tau_dots",
    )(up, wq, wv)
    return oq[:, :t], ov[:, :t]


def tau_dots_kernel(u: jax.Array, wq: jax.Array, wv: jax.Array, *, config: TauDotsConfig | None = None,
                    interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Kernel twin of `tau_dots_ref`: both products [T, H] in u.dtype (split partials added in float32)."""
    oq, ov = tau_dots_partials(u, wq, wv, config=config, interpret=interpret)
    return oq.sum(0).astype(u.dtype), ov.sum(0).astype(u.dtype)
