"""Pallas GPU (Triton backend) sampling kernel: same signature and same tokens as sample_reference.

The reference (sampling.py, step 4) defines the draw as two-level Gumbel-max proposals with
rejection; that definition was chosen so that a GPU can follow it without sorting and without
per-token noise outside one chunk per proposal. Two kernels, logits viewed as [B, NC, C]:

  statistics, grid (B, NC): per chunk, the max logit, its first index and the mass
    sum 2^((z - chunk max) * c2). One read of the logits: memory bound. Greedy rows compute
    only the argmax; restricted rows nothing.
  finish, grid (B,): per row, combines the chunks (max m, first argmax a, Z), draws proposal
    0 (chunk by Gumbel over chunk masses, then one chunk of token noise), and returns it at
    once if no filter is on, it is a, or only a can survive (top_k == 1 or 1 > top_p * Z).
    Otherwise each round is one pass over the row giving the count and mass of the candidates
    ranked before the proposal x (x survives iff count < top_k and mass <= top_p * Z) and the
    per-chunk masses of that set, from which the next proposal is drawn if x is rejected.
A pass streams tiles [NCP, W]: W consecutive tokens of every chunk at once (NCP = NC rounded
up to a power of two, padded rows masked), so each lane's accumulators belong to one chunk and
the loop body is elementwise only (the cross-lane reductions run once, after the loop); each
tile load is issued one iteration ahead of its use. Restricted rows (a few allowed ids) are
solved exactly in the finish kernel from their gathered logits. Float sums here differ from
the reference's in rounding only, which moves a Gumbel-max choice only at near-ties, so both
return the same token.

Measured and not kept (BENCHMARKS.md, third session): one program per row doing the
statistics too (a single SM streams the row 2-4x slower than 25 chunk programs), and one
kernel whose last chunk program finishes the row after an atomic ticket (saves 0.2 us at
B = 1, costs a zero-filled counter per call and 1-9 us at B >= 4). The first again in the
thirty-seventh session (H200), its statistics as one pass of per-lane running max / first index
/ rescaled mass over [NCP, W] tiles: greedy B = 1 5.6 us against 2.78 for the two launches
(W = 512; W >= 1024 spilled: 15-52 us), top-p 2-3x slower at every batch; faster only for
greedy bf16 rows at B = 128 (6.3 against 7.1 us). Removed.

Randomness: Pallas GPU has no PRNG primitive, so noise is a counter hash of (row key, stream,
index) evaluated in-kernel by the same jnp code the reference runs (sampling.gumbel2).

Why the Triton backend and not Mosaic GPU: this is a row-wise streaming reduction with integer
hashing, data-dependent loops and per-row early exits; it needs no TMA, wgmma or warpgroup
specialisation, and Triton lowers all of it (scf.while/if, u32 ops, libdevice log2/exp2) with
a mature CPU interpreter. Triton tensors must have power-of-two shapes (C, W and NCP are) and
none 1-wide.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kestrel_jax.pallas.sampling import (
    BIG_INDEX,
    MAX_ROUNDS,
    PROPOSAL_CHUNK,
    SampleOutput,
    SamplingParams,
    chunk_size,
    constrain,
    gumbel2,
    row_settings,
    sub_key,
    top_n_logprobs,
)

MAX_LIST_WIDTH = 64
NEG_INF = float("-inf")
DEFAULT_WIDTH = 128
DEFAULT_WARPS = 8


@dataclasses.dataclass(frozen=True)
class _Layout:
    vocab: int
    chunk: int  # C, power of two
    n_chunks: int  # NC = ceil(V / C)
    width: int  # W: tokens of each chunk per tile, a power of two dividing C

    @property
    def rows(self) -> int:  # NCP: chunk rows of a tile, a power of two >= 2
        return max(2, _pow2_ceil(self.n_chunks))

    @property
    def n_tiles(self) -> int:
        return self.chunk // self.width


def _pow2_ceil(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# ----------------------------------------------------------------------------------------------
# In-kernel helpers (traced inside the kernel; `b` is the row).


def _runtime_values(b, values: tuple) -> tuple:
    """Scalars that are values in the jaxpr, not literals: the Triton lowering of cond cannot
    yield a literal, so loop and branch carries start from these."""
    never = b < 0  # program ids are >= 0
    return tuple(
        jnp.where(never, jnp.zeros((), jnp.int32 if isinstance(v, int) else jnp.float32), v) for v in values
    )


def _id_list(ref, b, n: int) -> list:
    return [ref[b, j] for j in range(n)] if ref is not None else []


def _any_listed(ids: list, b):
    return functools.reduce(lambda r, t: r | (t >= 0), ids, b < 0)


def _lowest_free_id(supp: list, vocab: int):
    """Lowest token id not in `supp` (at most len(supp) steps up from 0)."""
    t = jnp.int32(0)
    for _ in supp:
        t = jnp.where(functools.reduce(lambda h, s: h | (t == s), supp, t < 0), t + 1, t)
    return jnp.minimum(t, vocab - 1)


def _clean(raw, idx, hit, supp: list, nan: bool = True):
    """Loaded logits -> f32 with NaN (unless nan=False: for callers whose compares are all
    false on NaN anyway) and suppressed ids at -inf. `hit` says whether any suppressed id is
    among `idx`, so the per-element compare runs only where it can match."""
    z = raw.astype(jnp.float32)
    if nan:
        z = jnp.where(z == z, z, NEG_INF)
    if supp:

        def apply(z):
            match = functools.reduce(lambda m_, s: m_ | (idx == s), supp, idx < 0)
            return jnp.where(match, NEG_INF, z)

        z = jax.lax.cond(hit, apply, lambda z: z, z)
    return z


def _all(reduce, x):
    """Reduce over every axis, one axis at a time: the Triton lowering of a multi-axis
    reduction drops the sharding of its intermediate and fails under an Explicit mesh."""
    while x.ndim:
        x = reduce(x, axis=-1)
    return x


def _first_max(v, idx):
    """(max of v, lowest idx attaining it)."""
    vmax = _all(jnp.max, v)
    return vmax, _all(jnp.min, jnp.where(v == vmax, idx, BIG_INDEX))


# ----------------------------------------------------------------------------------------------
# Chunk statistics (one program per chunk of a row).


def _chunk_stats(logits_ref, b, j, temp_ref, seed_ref, step_ref, allowed_ref, supp_ref, *, lay: _Layout,
                 n_allowed: int, n_supp: int, need_z: bool) -> tuple:
    """(max, first argmax, mass sum 2^((z - max) * c2)) of chunk j of row b. Restricted rows are
    solved from their allowed ids and skip this; greedy rows need the argmax only."""
    greedy, _, c2, _, _, _ = row_settings(temp_ref[b], jnp.int32(0), jnp.float32(1.0), seed_ref[b], step_ref[b],
                                          lay.vocab)
    supp = _id_list(supp_ref, b, n_supp)
    restricted = _any_listed(_id_list(allowed_ref, b, n_allowed), b)
    init = _runtime_values(b, (NEG_INF, BIG_INDEX, 0.0))
    # Loaded before the branches, so the load overlaps the settings' loads instead of waiting for
    # them (restricted rows, which do not need it, are rare).
    raw = plgpu.load(logits_ref.at[b, j, :])

    def stats(carry, with_mass: bool):
        lo = j * lay.chunk
        idx = lo + jnp.arange(lay.chunk, dtype=jnp.int32)
        hit = functools.reduce(lambda h, s: h | ((s >= lo) & (s < lo + lay.chunk)), supp, lo < 0)
        z = _clean(raw, idx, hit, supp)
        cm, carg = _first_max(z, idx)
        mass = carry[2]
        if with_mass:
            mass = jnp.sum(jnp.where(z > NEG_INF, jnp.exp2((z - cm) * c2), 0.0))
        return cm, carg, mass

    # Nested boolean conds, not lax.switch: the Triton lowering of switch's index clamp mixed i1
    # and i32 operands and failed to parse on the GPU.
    def unrestricted(c):
        if need_z:
            return stats(c, True)
        return jax.lax.cond(greedy, lambda c: stats(c, False), lambda c: stats(c, True), c)

    return jax.lax.cond(restricted, lambda c: c, unrestricted, init)


# ----------------------------------------------------------------------------------------------
# Finishing a row: combine the chunk statistics, draw, check, redraw.


def _finish_row(logits_ref, b, table_refs, temp_ref, top_k_ref, top_p_ref, seed_ref, step_ref, allowed_ref,
                supp_ref, out_refs, *, lay: _Layout, n_allowed: int, n_supp: int):
    """Samples row b from its chunk statistics (table_refs: max, argmax, mass, [B, NCP]) and
    writes (token, logprob, max, log Z) to out_refs."""
    greedy, inv_t, c2, top_k, top_p, key = row_settings(
        temp_ref[b], top_k_ref[b], top_p_ref[b], seed_ref[b], step_ref[b], lay.vocab
    )
    supp = _id_list(supp_ref, b, n_supp)
    allowed = _id_list(allowed_ref, b, n_allowed)
    cmax, carg, cmass = _load_tables(table_refs, b, lay)  # issued first: overlaps the settings' loads
    C, W, NCP, NT = lay.chunk, lay.width, lay.rows, lay.n_tiles
    cid = jnp.arange(NCP, dtype=jnp.int32)
    rows = cid[:, None]
    lanes = jnp.arange(W, dtype=jnp.int32)[None, :]
    zero_f, zero_i = _runtime_values(b, (0.0, 0))

    def full(v):
        return jnp.broadcast_to(v, (NCP, W))

    # Passes over the row stream tiles [NCP, W]: tokens t*W .. t*W + W - 1 of every chunk, so
    # each lane's accumulator belongs to one chunk and the loop body is elementwise only.

    def load(t):
        t = jnp.minimum(t, NT - 1)  # the prefetch past the last tile re-reads it
        view = logits_ref.at[b, pl.ds(zero_i, NCP), pl.ds(t * W, W)]
        if lay.n_chunks == NCP:
            return plgpu.load(view)
        return plgpu.load(view, mask=full(rows < lay.n_chunks), other=NEG_INF)

    def stream(body, carry):
        """Runs body(idx, z, carry) -> carry over every tile, the next tile prefetched. NaN
        logits stay NaN in z: the bodies only count elements by ordered compares with a real
        logit, which are false on NaN, as on -inf."""

        def step(t, c):
            raw, inner = c
            nxt = load(t + 1)  # issued before the work on this tile: hides its latency
            idx = rows * C + t * W + lanes
            hit = functools.reduce(lambda h, s: h | ((s >= 0) & ((s % C) // W == t)), supp, t < 0)
            return nxt, body(idx, _clean(raw, idx, hit, supp, nan=False), inner)

        return jax.lax.fori_loop(0, NT, step, (load(0), carry))[1]

    def survives(count, mass, zsum):
        return ((top_k == 0) | (count < top_k)) & ((top_p >= 1.0) | (mass <= top_p * zsum))

    def logit(x):
        return logits_ref[b, x // C, x % C].astype(jnp.float32)

    def draw(logw, r, x_prev, z_prev):
        """Proposal r from chunk log-masses logw [NCP]; the set is the candidates ranked
        before x_prev (r > 0) or all candidates (r == 0)."""
        cs = logw + gumbel2(sub_key(key, 2 * r), cid)
        _, j = _first_max(cs, cid)
        idx = j * C + jnp.arange(C, dtype=jnp.int32)
        hit = functools.reduce(lambda h, s: h | ((s >= 0) & (s // C == j)), supp, j < 0)
        z = _clean(plgpu.load(logits_ref.at[b, j, :]), idx, hit, supp)
        in_set = z > NEG_INF
        if x_prev is not None:
            in_set &= (z > z_prev) | ((z == z_prev) & (idx < x_prev))
        sc = jnp.where(in_set, z * c2 + gumbel2(sub_key(key, 2 * r + 1), idx), NEG_INF)
        return _first_max(sc, idx)[1]

    def ranked_before(x, zx, m):
        """One pass: (count, per-chunk masses [NCP]) of the candidates ranked before x."""

        def body(idx, z, c):
            count, mass = c
            above = (z > zx) | ((z == zx) & (idx < x))
            return count + above.astype(jnp.int32), mass + jnp.where(above, jnp.exp2((z - m) * c2), 0.0)

        count, mass = stream(body, (full(zero_i), full(zero_f)))
        return _all(jnp.sum, count), jnp.sum(mass, axis=1)

    def full_row():
        m = jnp.max(cmax)
        a = jnp.min(jnp.where(cmax == m, carg, BIG_INDEX))
        has_cand = m > NEG_INF  # else chunk argmaxes point at -inf (possibly suppressed) ids
        a = jnp.where(has_cand, a, _lowest_free_id(supp, lay.vocab))
        zsum = jnp.sum(jnp.where(cmass > 0, cmass * jnp.exp2((cmax - m) * c2), 0.0))
        only_top = (top_k == 1) | (top_p * zsum < 1.0)
        no_filter = (top_k == 0) & (top_p >= 1.0)
        settled = greedy | ~has_cand | (only_top & ~no_filter)

        def first_proposal(_):
            logw0 = jnp.where(cmass > 0, jnp.log2(jnp.where(cmass > 0, cmass, 1.0)) + cmax * c2, NEG_INF)
            return draw(logw0, 0, None, None)

        x = jax.lax.cond(settled, lambda a_: a_, first_proposal, a)
        done = settled | no_filter | (x == a)

        def round_step(state):
            x, _, r = state
            zx = logit(x)
            count, wt = ranked_before(x, zx, m)
            accept = survives(count, jnp.sum(wt), zsum)
            capped = r >= MAX_ROUNDS  # past the cap: the top token (always a survivor)

            def redraw(x):
                logw = jnp.where(wt > 0, jnp.log2(jnp.where(wt > 0, wt, 1.0)), NEG_INF)
                return draw(logw, r + 1, x, zx)

            x = jax.lax.cond(accept | capped, lambda x_: jnp.where(accept, x_, a), redraw, x)
            return x, accept | capped | (x == a), r + 1

        x, _, _ = jax.lax.while_loop(lambda st: ~st[1], round_step, (x, done, jnp.int32(0)))
        return x, m, zsum, has_cand & (x == a)

    def restricted_row():
        width = max(2, _pow2_ceil(n_allowed))  # Triton tensors: powers of two, none 1-wide
        slots = jnp.arange(width, dtype=jnp.int32)
        ids = jnp.full((width,), -1, jnp.int32)
        zs = jnp.full((width,), NEG_INF, jnp.float32)
        ok = slots < 0
        for j, t in enumerate(allowed):
            fresh = (t >= 0) & (t < lay.vocab)
            for other in supp + allowed[:j]:
                fresh &= t != other
            zt = logit(jnp.clip(t, 0, lay.vocab - 1))
            zt = jnp.where(fresh & (zt == zt), zt, NEG_INF)
            ids = jnp.where(slots == j, t, ids)
            zs = jnp.where(slots == j, zt, zs)
            ok = jnp.where(slots == j, fresh, ok)
        # No candidate at all (invalid settings): the lowest allowed id in range, else 0.
        in_range = jnp.min(jnp.where((ids >= 0) & (ids < lay.vocab), ids, BIG_INDEX))
        empty_tok = jnp.where(in_range == BIG_INDEX, 0, in_range)
        m = jnp.max(zs)
        lowest = jnp.min(jnp.where(ok, ids, BIG_INDEX))
        first = jnp.min(jnp.where(ok & (zs == m), ids, BIG_INDEX))
        first = jnp.where(m == NEG_INF, jnp.where(lowest == BIG_INDEX, empty_tok, lowest), first)
        w = jnp.where(zs > NEG_INF, jnp.exp2((zs - m) * c2), 0.0)
        zsum = jnp.sum(w)
        # above[i, j]: candidate i ranks before candidate j.
        zi, zj = zs[:, None], zs[None, :]
        above = ok[:, None] & ((zi > zj) | ((zi == zj) & (ids[:, None] < ids[None, :])))
        count = jnp.sum(above.astype(jnp.int32), axis=0)
        mass = jnp.sum(jnp.where(above, w[:, None], 0.0), axis=0)
        kept = ok & (zs > NEG_INF) & survives(count, mass, zsum)
        sc = jnp.where(kept, zs * c2 + gumbel2(sub_key(key, 1), ids), NEG_INF)
        drawn = jnp.min(jnp.where(kept & (sc == jnp.max(sc)), ids, BIG_INDEX))
        tok = jnp.where(greedy | (m == NEG_INF), first, drawn)
        return tok, m, zsum, (m > NEG_INF) & (tok == first)

    if not allowed:
        tok, m, zsum, at_max = full_row()
    else:
        tok, m, zsum, at_max = jax.lax.cond(_any_listed(allowed, b), restricted_row, full_row)
    # The token's logit is m when it is the argmax (every greedy row): no dependent load then.
    # tok is always in range; the clip only makes sure a bug can never read out of bounds.
    zt = jax.lax.cond(at_max, lambda: m, lambda: logit(jnp.clip(tok, 0, lay.vocab - 1)))
    lp = jnp.where((m == NEG_INF) | ~(zt > NEG_INF), NEG_INF, (zt - m) * inv_t - jnp.log(zsum))
    for ref, v in zip(out_refs, (tok, lp, m, jnp.log(zsum)), strict=True):
        ref[b] = v


# ----------------------------------------------------------------------------------------------
# Kernels.


def _split_lists(rest, n_allowed: int, n_supp: int):
    allowed_ref = rest[0] if n_allowed else None
    supp_ref = rest[int(bool(n_allowed))] if n_supp else None
    return allowed_ref, supp_ref, rest[int(bool(n_allowed)) + int(bool(n_supp)):]


def _load_tables(table_refs: tuple, b, lay: _Layout):
    max_ref, arg_ref, mass_ref = table_refs
    valid = jnp.arange(lay.rows, dtype=jnp.int32) < lay.n_chunks
    return (plgpu.load(max_ref.at[b], mask=valid, other=NEG_INF),
            plgpu.load(arg_ref.at[b], mask=valid, other=BIG_INDEX),
            plgpu.load(mass_ref.at[b], mask=valid, other=0.0))


def _stats_kernel(logits_ref, temp_ref, seed_ref, step_ref, *rest, lay: _Layout, n_allowed: int, n_supp: int,
                  need_z: bool):
    """Kernel 1, grid (B, NC): the chunk statistics tables."""
    allowed_ref, supp_ref, (max_ref, arg_ref, mass_ref) = _split_lists(rest, n_allowed, n_supp)
    b, j = pl.program_id(0), pl.program_id(1)
    out = _chunk_stats(logits_ref, b, j, temp_ref, seed_ref, step_ref, allowed_ref, supp_ref, lay=lay,
                       n_allowed=n_allowed, n_supp=n_supp, need_z=need_z)
    for ref, v in zip((max_ref, arg_ref, mass_ref), out, strict=True):
        ref[b, j] = v


def _finish_kernel(max_ref, arg_ref, mass_ref, logits_ref, temp_ref, top_k_ref, top_p_ref, seed_ref, step_ref,
                   *rest, lay: _Layout, n_allowed: int, n_supp: int):
    """Kernel 2, grid (B,): one program finishes each row."""
    allowed_ref, supp_ref, out_refs = _split_lists(rest, n_allowed, n_supp)
    b = pl.program_id(0)
    _finish_row(logits_ref, b, (max_ref, arg_ref, mass_ref), temp_ref, top_k_ref, top_p_ref, seed_ref, step_ref,
                allowed_ref, supp_ref, out_refs, lay=lay, n_allowed=n_allowed, n_supp=n_supp)


# ----------------------------------------------------------------------------------------------
# Wrapper.


def sample_kernel_supported(logits: jax.Array, params: SamplingParams) -> bool:
    """Whether sample_kernel can run these shapes on the current default backend (a CUDA GPU)."""
    try:
        dev = jax.devices()[0]
        if jax.default_backend() != "gpu" or "cuda" not in str(dev.client.platform_version).lower():
            return False
    except (RuntimeError, AttributeError):
        return False
    return _shape_problem(logits, params) is None


def _shape_problem(logits: jax.Array, params: SamplingParams) -> str | None:
    if logits.ndim != 2:
        return f"logits must be [B, V], got shape {logits.shape}"
    if jnp.dtype(logits.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"logits dtype must be float32, bfloat16 or float16, got {logits.dtype}"
    B, V = logits.shape
    if not 1 <= V < 2**30:
        return f"vocabulary size {V} out of range [1, 2^30)"
    for name in ("temperature", "top_k", "top_p", "seed", "step"):
        if getattr(params, name).shape != (B,):
            return f"params.{name} must have shape ({B},), got {getattr(params, name).shape}"
    for name in ("allowed_ids", "suppressed_ids"):
        ids = getattr(params, name)
        if ids is not None and (ids.ndim != 2 or ids.shape[0] != B or ids.shape[1] > MAX_LIST_WIDTH):
            return f"params.{name} must be [{B}, <= {MAX_LIST_WIDTH}], got {ids.shape}"
    return None


@jax.jit(static_argnames=("n_top", "return_logprobs", "chunk", "interpret", "width", "num_warps"))
def sample_kernel(
    logits: jax.Array,  # [B, V] f32 / bf16 / f16
    params: SamplingParams,
    *,
    n_top: int = 0,
    return_logprobs: bool = False,
    chunk: int = PROPOSAL_CHUNK,
    interpret: bool = False,
    width: int = DEFAULT_WIDTH,
    num_warps: int = DEFAULT_WARPS,
) -> SampleOutput:
    """Pallas version of sample_reference: same arguments, plus `interpret` (run the kernels in
    the Pallas interpreter, for CPU tests) and two that change speed, not results: `width`
    (tokens of each chunk per tile of a pass over the row, a power of two) and `num_warps` (of
    the row-finishing program). V % C != 0 costs one padded copy."""
    problem = _shape_problem(logits, params)
    if problem is not None:
        raise ValueError(f"sample_kernel: {problem}")
    for name, v in (("chunk", chunk), ("width", width), ("num_warps", num_warps)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"sample_kernel: {name} must be a power of two, got {v}")
    B, V = logits.shape
    C = chunk_size(V, chunk)
    NC = -(-V // C)
    lay = _Layout(V, C, NC, max(2, min(width, C)))
    if NC * C != V:
        logits = jnp.pad(logits, ((0, 0), (0, NC * C - V)), constant_values=-jnp.inf)
    logits3 = logits.reshape(B, NC, C)
    lists = [x.astype(jnp.int32) for x in (params.allowed_ids, params.suppressed_ids) if x is not None and x.shape[1]]
    n_allowed = params.allowed_ids.shape[1] if params.allowed_ids is not None else 0
    n_supp = params.suppressed_ids.shape[1] if params.suppressed_ids is not None else 0
    temp, top_k, top_p = (params.temperature.astype(jnp.float32), params.top_k.astype(jnp.int32),
                          params.top_p.astype(jnp.float32))
    seed, step = params.seed.astype(jnp.uint32), params.step.astype(jnp.int32)

    f32, i32 = jnp.float32, jnp.int32
    need_z = return_logprobs or n_top > 0
    kw: dict[str, Any] = dict(lay=lay, n_allowed=n_allowed, n_supp=n_supp)
    tables = [jax.ShapeDtypeStruct((B, lay.rows), t) for t in (f32, i32, f32)]
    rows_out = [jax.ShapeDtypeStruct((B,), t) for t in (i32, f32, f32, f32)]
    chunk_tables = pl.pallas_call(
        functools.partial(_stats_kernel, need_z=need_z, **kw),
        out_shape=tables,
        grid=(B, NC),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="sample_chunk_stats",
    )(logits3, temp, seed, step, *lists)
    tok, lp, m, log_z = pl.pallas_call(
        functools.partial(_finish_kernel, **kw),
        out_shape=rows_out,
        grid=(B,),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="sample_finish",
    )(*chunk_tables, logits3, temp, top_k, top_p, seed, step, *lists)

    out = SampleOutput(tokens=tok)
    if return_logprobs:
        out = out._replace(logprobs=lp)
    if n_top:
        z, _ = constrain(logits[:, :V], params)
        inv_t = row_settings(temp, top_k, top_p, seed, step, V)[1]
        ids, top_lp = top_n_logprobs(z, m, log_z, inv_t, n_top)
        out = out._replace(top_ids=ids, top_logprobs=top_lp)
    return out
