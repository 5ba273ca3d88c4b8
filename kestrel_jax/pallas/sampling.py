"""Token sampling for the decode step: the pure-jnp reference, the public API and the host helper.

One call samples every row of a [B, V] logits block with per-row settings (SamplingParams).
Semantics, in order, for one row (MOONDREAM.md §9.1, generalised):

1. Constraints. NaN logits count as -inf. `suppressed_ids` are excluded; a row that lists at
   least one id >= 0 in `allowed_ids` is restricted to those ids (suppression still applies).
   Excluded tokens are never returned. Candidates are the tokens not excluded.
2. Greedy rows (temperature < MIN_TEMPERATURE, which includes 0): the candidate with the
   largest logit, lowest index on ties. If every candidate is -inf, the lowest-index candidate.
3. Sampled rows: p = softmax(logits / T) over the candidates, computed in f32 (Moondream's own
   code computes it in the logits dtype, bf16, which keeps ~3 significant digits; f32 is the
   more accurate choice). Candidates are ranked by logit, descending, ties
   by lower index first (a stable sort by probability). A token survives
     top-k: its rank < top_k               (top_k <= 0 or >= V: off)
     top-p: the mass ranked before it <= top_p   (top_p >= 1: off; rank 0 always survives)
   and is kept only if it survives both ("joint" filtering: both filters see the same
   temperature-scaled distribution; Moondream itself uses top-p only, so this choice never
   affects parity). The survivors are renormalised and one is drawn.
4. The draw (exact for that distribution, reproducible, sort-free on the GPU). Noise G(key, n) is
   a log2-domain Gumbel variate from a counter-based hash evaluated where it is needed (in the
   kernel too: Pallas GPU has no PRNG, and passing V uniforms per row in would cost a second
   logits-sized read); key = hash(seed, step), deliberately not the row's batch position, and
   each proposal r uses its own two sub-keys. The vocabulary is cut into chunks of
   C = min(chunk, 2^floor(log2 V)) tokens. A proposal from a set S of candidates is a
   two-level Gumbel-max draw: chunk j = argmax log2(mass of S in j) + G(ck_r, j), then token
   i = argmax over S in chunk j of logit_i * log2(e) / T + G(ek_r, i); this is a draw with
   probability proportional to p over S. Proposal 0 uses S = all candidates; while the
   proposal x is not a survivor, proposal r + 1 uses S = the candidates ranked before x (a
   superset of the survivors). The first surviving proposal is returned: rejection sampling,
   so the result has exactly the renormalised survivor distribution (after MAX_ROUNDS
   redraws, practically never, the top token is returned). Restricted rows (a few allowed
   ids) draw token = argmax over survivors of logit * log2(e) / T + G(ek_0, id) directly.
   The token depends only on the row's own logits, settings, seed and step, never on the
   batch around it. The Pallas kernel makes the same decisions from its own float sums, which
   differ from these in rounding only; Gumbel-max choices are insensitive to that, so both
   return the same token except at float near-ties (~1e-6 per draw).

Log-probabilities (optional) are of the temperature-scaled distribution after constraints and
before top-k/top-p (greedy rows use T = 1): log_softmax(logits / T)[token]. The top-n pairs use
the same distribution; entries with logprob -inf are padding (the row has fewer candidates).
Rows with no candidate at all (every allowed id suppressed or out of range) return the lowest
allowed id in range (else 0) with logprob -inf: invalid settings, rejected by
make_sampling_params on the host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# Temperatures below this are greedy (as in vLLM): 1/T would overflow the f32 score range.
MIN_TEMPERATURE = 1e-5
LOG2E = 1.4426950408889634
# Index sentinel larger than any vocabulary position.
BIG_INDEX = 2**31 - 1
# Chunk size of the two-level draw (part of the definition of which token a seed gives).
PROPOSAL_CHUNK = 2048
# Redraw cap; each redraw strictly raises the proposal's rank, and the expected number is
# ~1 + ln(1 / survivor mass), so the cap is only a guard.
MAX_ROUNDS = 64

_GOLDEN = 0x9E3779B1
_SEED_SALT = 0x632BE5AB
_STREAM_SALT = 0x2545F491


# Host helpers build numpy arrays; inside jit they are jax arrays.
Arr = jax.Array | np.ndarray


class SamplingParams(NamedTuple):
    """Per-row sampling settings; every field has leading dimension B. A pytree: pass it to
    the jitted step as is (None fields are static absences)."""

    temperature: Arr  # f32[B]; < MIN_TEMPERATURE = greedy
    top_k: Arr  # i32[B]; <= 0 = off
    top_p: Arr  # f32[B]; >= 1 = off
    seed: Arr  # u32[B]
    step: Arr  # i32[B]; advance by one per decode step
    allowed_ids: Arr | None = None  # i32[B, A], -1 padded; restricted iff any id >= 0
    suppressed_ids: Arr | None = None  # i32[B, S], -1 padded


class SampleOutput(NamedTuple):
    tokens: jax.Array  # i32[B]
    logprobs: jax.Array | None = None  # f32[B]
    top_ids: jax.Array | None = None  # i32[B, n]
    top_logprobs: jax.Array | None = None  # f32[B, n]


class RowControls(NamedTuple):
    """Per-row quantities derived once from SamplingParams (shared by reference and kernel)."""

    greedy: jax.Array  # bool[B]
    inv_t: jax.Array  # f32[B]; 1/T, or 1 for greedy rows
    c2: jax.Array  # f32[B]; inv_t * log2(e): scale of logits in the log2 domain
    top_k: jax.Array  # i32[B]; 0 when off
    top_p: jax.Array  # f32[B]; in [0, 1]; 1 when off
    key: jax.Array  # u32[B]
    restricted: jax.Array  # bool[B]


# ----------------------------------------------------------------------------------------------
# Counter-based randomness (uint32 arithmetic wraps; the same code runs inside the kernel).


def mix32(x: jax.Array) -> jax.Array:
    """A 32-bit integer finaliser (xor-shift / multiply rounds); bijective on uint32."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def row_key(seed: jax.Array, step: jax.Array) -> jax.Array:
    """u32[B] seed, i32[B] step -> u32[B] key of one draw."""
    s = mix32(seed.astype(jnp.uint32) ^ jnp.uint32(_SEED_SALT))
    return mix32(s ^ (step.astype(jnp.uint32) * jnp.uint32(_GOLDEN)))


def sub_key(key: jax.Array, n) -> jax.Array:
    """Key of noise stream n (2r: chunk level of proposal r, 2r + 1: token level)."""
    return mix32(key ^ mix32(jnp.asarray(n).astype(jnp.uint32) + jnp.uint32(_STREAM_SALT)))


def chunk_size(vocab_size: int, chunk: int) -> int:
    """Effective chunk of the two-level draw: a power of two, at most the vocabulary."""
    return min(chunk, 1 << (vocab_size.bit_length() - 1))


def gumbel2(key: jax.Array, idx: jax.Array) -> jax.Array:
    """Log2-domain Gumbel noise -log2(-log2(u)) for token ids `idx` under `key` (broadcasts).

    u = (2m + 1) * 2^-24 for a 23-bit m from the hash, so u is exact and in (0, 1). For u near 1,
    -log2(u) loses all precision; there d = 1 - u is exact and a series of -ln(1 - d) is used.
    """
    h = mix32((idx.astype(jnp.uint32) * jnp.uint32(_GOLDEN)) ^ key)
    one_to_two = jax.lax.bitcast_convert_type((h >> 9) | jnp.uint32(0x3F800000), jnp.float32)
    u = one_to_two - jnp.float32(1.0 - 2.0**-24)
    d = 1.0 - u
    series = d * (1.0 + d * (0.5 + d * (1.0 / 3.0 + d * (0.25 + d * 0.2))))
    e2 = jnp.where(d < 2.0**-6, series * LOG2E, -jnp.log2(u))
    return -jnp.log2(e2)


# ----------------------------------------------------------------------------------------------
# Shared preprocessing.


def row_settings(temperature, top_k, top_p, seed, step, vocab_size: int) -> tuple:
    """Derived per-row controls; works on [B] arrays (reference) and on scalars (inside the
    kernel), so both sides derive them with the same operations.
    -> (greedy, inv_t, c2, top_k (0 = off), top_p (1 = off), key)."""
    t = temperature.astype(jnp.float32)
    greedy = ~(t >= MIN_TEMPERATURE)
    inv_t = jnp.where(greedy, 1.0, 1.0 / jnp.where(greedy, 1.0, t)).astype(jnp.float32)
    k = top_k.astype(jnp.int32)
    k = jnp.where((k <= 0) | (k >= vocab_size), 0, k)
    p = top_p.astype(jnp.float32)
    p = jnp.where(p < 1.0, jnp.maximum(p, 0.0), 1.0)
    return greedy, inv_t, inv_t * LOG2E, k, p, row_key(seed, step)


def row_controls(params: SamplingParams, vocab_size: int) -> RowControls:
    greedy, inv_t, c2, top_k, top_p, key = row_settings(
        params.temperature, params.top_k, params.top_p, params.seed, params.step, vocab_size
    )
    if params.allowed_ids is None:
        restricted = jnp.zeros(greedy.shape, bool)
    else:
        restricted = jnp.any(params.allowed_ids >= 0, axis=1)
    return RowControls(greedy, inv_t, c2, top_k, top_p, key, restricted)


def fallback_token(params: SamplingParams, vocab_size: int) -> jax.Array:
    """i32[B]: the token of a row without candidates: lowest allowed id in range, else 0."""
    if params.allowed_ids is None:
        return jnp.zeros(params.temperature.shape, jnp.int32)
    a = params.allowed_ids.astype(jnp.int32)
    ok = (a >= 0) & (a < vocab_size)
    low = jnp.min(jnp.where(ok, a, BIG_INDEX), axis=1)
    return jnp.where(low == BIG_INDEX, 0, low).astype(jnp.int32)


def constrain(logits: jax.Array, params: SamplingParams) -> tuple[jax.Array, jax.Array]:
    """[B, V] logits -> (f32 logits with excluded and NaN entries at -inf, bool candidates)."""
    B, V = logits.shape
    z = logits.astype(jnp.float32)
    z = jnp.where(jnp.isnan(z), -jnp.inf, z)
    idx = jnp.arange(V, dtype=jnp.int32)
    cand = jnp.ones((B, V), bool)
    if params.suppressed_ids is not None:
        sup = params.suppressed_ids.astype(jnp.int32)
        cand &= ~jnp.any(idx[None, None, :] == sup[:, :, None], axis=1)
    if params.allowed_ids is not None:
        allow = params.allowed_ids.astype(jnp.int32)
        listed = jnp.any(idx[None, None, :] == allow[:, :, None], axis=1)
        restricted = jnp.any(allow >= 0, axis=1)
        cand &= listed | ~restricted[:, None]
    return jnp.where(cand, z, -jnp.inf), cand


def top_n_logprobs(
    z: jax.Array,  # [B, V] f32 constrained logits
    m: jax.Array,  # [B] row max of z
    log_z: jax.Array,  # [B] log of sum exp((z - m) * inv_t)
    inv_t: jax.Array,  # [B]
    n_top: int,
) -> tuple[jax.Array, jax.Array]:
    vals, ids = jax.lax.top_k(z, n_top)
    lp = (vals - m[:, None]) * inv_t[:, None] - log_z[:, None]
    return ids.astype(jnp.int32), jnp.where(vals == -jnp.inf, -jnp.inf, lp)


# ----------------------------------------------------------------------------------------------
# Reference.


def _two_level_draw(z3, in_set, chunk_logw, c2, key, r):
    """One proposal (module docstring, step 4). z3 [B, NC, C] f32 logits, in_set [B, NC, C]
    bool, chunk_logw [B, NC] log2 chunk masses (-inf: empty), r: proposal number -> i32[B]."""
    B, NC, C = z3.shape
    cs = chunk_logw + gumbel2(sub_key(key, 2 * r)[:, None], jnp.arange(NC, dtype=jnp.int32)[None, :])
    j = jnp.argmax(cs, axis=1).astype(jnp.int32)
    zc = jnp.take_along_axis(z3, j[:, None, None], axis=1)[:, 0]
    ok = jnp.take_along_axis(in_set, j[:, None, None], axis=1)[:, 0] & (zc > -jnp.inf)
    idx = j[:, None] * C + jnp.arange(C, dtype=jnp.int32)[None, :]
    sc = jnp.where(ok, zc * c2[:, None] + gumbel2(sub_key(key, 2 * r + 1)[:, None], idx), -jnp.inf)
    return j * C + jnp.argmax(sc, axis=1).astype(jnp.int32)


def _log2_or_neg_inf(w: jax.Array) -> jax.Array:
    return jnp.where(w > 0, jnp.log2(jnp.where(w > 0, w, 1.0)), -jnp.inf)


@jax.jit(static_argnames=("n_top", "return_logprobs", "chunk"))
def sample_reference(
    logits: jax.Array,  # [B, V] any float dtype
    params: SamplingParams,
    *,
    n_top: int = 0,
    return_logprobs: bool = False,
    chunk: int = PROPOSAL_CHUNK,
) -> SampleOutput:
    """Sort-based definition of the sampler (module docstring); the CPU path and the test oracle."""
    B, V = logits.shape
    ctl = row_controls(params, V)
    z, cand = constrain(logits, params)
    idx = jnp.arange(V, dtype=jnp.int32)
    rows = jnp.arange(B)
    m = jnp.max(z, axis=1)  # -inf when every candidate is -inf (or there is none)
    first_max = jnp.min(jnp.where(cand & (z == m[:, None]), idx, BIG_INDEX), axis=1)
    greedy_tok = jnp.where(first_max == BIG_INDEX, fallback_token(params, V), first_max)

    # Survivors, by the spec: stable sort, exclusive cumulative mass, both filters.
    finite_m = jnp.where(m == -jnp.inf, 0.0, m)
    w = jnp.where(z > -jnp.inf, jnp.exp2((z - finite_m[:, None]) * ctl.c2[:, None]), 0.0)
    total = jnp.sum(w, axis=1)
    order = jnp.argsort(-z, axis=1, stable=True)  # rank order: logit desc, index asc
    w_sorted = jnp.take_along_axis(w, order, axis=1)
    before = jnp.concatenate([jnp.zeros((B, 1), jnp.float32), jnp.cumsum(w_sorted, axis=1)[:, :-1]], 1)
    rank = jnp.arange(V, dtype=jnp.int32)[None, :]
    keep_k = (ctl.top_k[:, None] <= 0) | (rank < ctl.top_k[:, None])
    keep_p = (ctl.top_p[:, None] >= 1.0) | (before <= ctl.top_p[:, None] * total[:, None])
    keep = jnp.zeros((B, V), bool).at[rows[:, None], order].set((keep_k & keep_p) | (rank == 0))

    # Restricted rows: direct Gumbel-max over the survivors.
    noise0 = gumbel2(sub_key(ctl.key, 1)[:, None], idx[None, :])
    direct = jnp.argmax(jnp.where(keep & (z > -jnp.inf), z * ctl.c2[:, None] + noise0, -jnp.inf), axis=1)

    # Other rows: two-level proposals with rejection.
    C = chunk_size(V, chunk)
    NC = -(-V // C)
    z3 = jnp.pad(z, ((0, 0), (0, NC * C - V)), constant_values=-jnp.inf).reshape(B, NC, C)
    idx3 = jnp.arange(NC * C, dtype=jnp.int32).reshape(1, NC, C)
    m_j = jnp.max(z3, axis=2)
    fm_j = jnp.where(m_j == -jnp.inf, 0.0, m_j)
    w0 = jnp.sum(jnp.where(z3 > -jnp.inf, jnp.exp2((z3 - fm_j[..., None]) * ctl.c2[:, None, None]), 0.0), axis=2)
    logw0 = jnp.where(w0 > 0, _log2_or_neg_inf(w0) + m_j * ctl.c2[:, None], -jnp.inf)
    x0 = _two_level_draw(z3, z3 > -jnp.inf, logw0, ctl.c2, ctl.key, 0)
    w3 = jnp.pad(w, ((0, 0), (0, NC * C - V))).reshape(B, NC, C)

    def is_kept(x):
        return keep[rows, x]

    def redraw(state):
        x, done, r = state
        zx = z[rows, x][:, None, None]
        above = (z3 > zx) | ((z3 == zx) & (idx3 < x[:, None, None]))
        logw = _log2_or_neg_inf(jnp.sum(jnp.where(above, w3, 0.0), axis=2))
        # Past the cap: the top token, which always survives, so the loop ends.
        nxt = jnp.where(r < MAX_ROUNDS, _two_level_draw(z3, above, logw, ctl.c2, ctl.key, r + 1), first_max)
        x = jnp.where(done, x, nxt)
        return x, done | is_kept(x), r + 1

    sampled = ~ctl.greedy & ~ctl.restricted & (m > -jnp.inf)
    x, _, _ = jax.lax.while_loop(
        lambda st: ~jnp.all(st[1]), redraw, (x0, ~sampled | is_kept(x0), jnp.int32(0))
    )
    drawn = jnp.where(ctl.restricted, direct, x).astype(jnp.int32)
    tokens = jnp.where(ctl.greedy | (m == -jnp.inf), greedy_tok, drawn)

    out = SampleOutput(tokens=tokens)
    if return_logprobs or n_top:
        lse = jax.nn.logsumexp(z * ctl.inv_t[:, None], axis=1)
        lp_all = jnp.where(z > -jnp.inf, z * ctl.inv_t[:, None] - lse[:, None], -jnp.inf)
        if return_logprobs:
            out = out._replace(logprobs=lp_all[rows, tokens])
        if n_top:
            _, ids = jax.lax.top_k(z, n_top)
            out = out._replace(top_ids=ids.astype(jnp.int32), top_logprobs=jnp.take_along_axis(lp_all, ids, axis=1))
    return out


# ----------------------------------------------------------------------------------------------
# Public entry point.

Backend = Literal["auto", "reference", "kernel"]


def sample(
    logits: jax.Array,  # [B, V]
    params: SamplingParams,
    *,
    n_top: int = 0,
    return_logprobs: bool = False,
    backend: Backend = "auto",
) -> SampleOutput:
    """Sample one token per row. "auto" uses the Pallas kernel on a CUDA GPU when it supports
    the shapes, else the reference; both give the same tokens (module docstring)."""
    from kestrel_jax.pallas import sampling_kernel  # the kernel module imports this one

    if backend not in ("auto", "reference", "kernel"):
        raise ValueError(f"backend must be 'auto', 'reference' or 'kernel', got {backend!r}")
    use_kernel = backend == "kernel" or (
        backend == "auto" and sampling_kernel.sample_kernel_supported(logits, params)
    )
    if use_kernel:  # backend="kernel" off a GPU runs the Pallas interpreter (slow; for tests)
        return sampling_kernel.sample_kernel(
            logits, params, n_top=n_top, return_logprobs=return_logprobs, interpret=jax.default_backend() != "gpu"
        )
    return sample_reference(logits, params, n_top=n_top, return_logprobs=return_logprobs)


# ----------------------------------------------------------------------------------------------
# Host-side construction.


@dataclasses.dataclass(frozen=True)
class RowSampling:
    """One request's settings for one decode step."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    step: int = 0
    allowed_ids: tuple[int, ...] = ()
    suppressed_ids: tuple[int, ...] = ()


def make_sampling_params(
    rows: Sequence[RowSampling | None],
    batch_size: int,
    *,
    n_allowed: int = 2,
    n_suppressed: int = 2,
    vocab_size: int | None = None,
) -> SamplingParams:
    """Build numpy SamplingParams for a batch bucket. `None` rows and rows past len(rows) are
    padding: greedy and unconstrained (cheapest). n_allowed / n_suppressed fix the constraint
    widths (static per compiled bucket); 0 leaves that field None."""
    if len(rows) > batch_size:
        raise ValueError(f"{len(rows)} rows do not fit a batch of {batch_size}; use a larger bucket")
    if n_allowed < 0 or n_suppressed < 0:
        raise ValueError("n_allowed and n_suppressed must be >= 0")
    temp = np.zeros(batch_size, np.float32)
    top_k = np.zeros(batch_size, np.int32)
    top_p = np.ones(batch_size, np.float32)
    seed = np.zeros(batch_size, np.uint32)
    step = np.zeros(batch_size, np.int32)
    allowed = np.full((batch_size, n_allowed), -1, np.int32)
    suppressed = np.full((batch_size, n_suppressed), -1, np.int32)
    for i, r in enumerate(rows):
        if r is None:
            continue
        _validate_row(i, r, n_allowed, n_suppressed, vocab_size)
        temp[i], top_k[i], top_p[i] = r.temperature, r.top_k, r.top_p
        seed[i], step[i] = r.seed, r.step
        allowed[i, : len(r.allowed_ids)] = r.allowed_ids
        suppressed[i, : len(r.suppressed_ids)] = r.suppressed_ids
    return SamplingParams(
        temperature=temp,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        step=step,
        allowed_ids=allowed if n_allowed else None,
        suppressed_ids=suppressed if n_suppressed else None,
    )


def _validate_row(i: int, r: RowSampling, n_allowed: int, n_suppressed: int, vocab: int | None) -> None:
    if not (np.isfinite(r.temperature) and r.temperature >= 0):
        raise ValueError(f"row {i}: temperature must be finite and >= 0, got {r.temperature}")
    if not 0.0 <= r.top_p <= 1.0:
        raise ValueError(f"row {i}: top_p must be in [0, 1] (1 = off), got {r.top_p}")
    if r.top_k < 0:
        raise ValueError(f"row {i}: top_k must be >= 0 (0 = off), got {r.top_k}")
    if not 0 <= r.seed < 2**32:
        raise ValueError(f"row {i}: seed must fit in uint32, got {r.seed}")
    if not 0 <= r.step < 2**31:
        raise ValueError(f"row {i}: step must fit in int32 and be >= 0, got {r.step}")
    for name, ids, width in (
        ("allowed_ids", r.allowed_ids, n_allowed),
        ("suppressed_ids", r.suppressed_ids, n_suppressed),
    ):
        if len(ids) > width:
            raise ValueError(f"row {i}: {len(ids)} {name} exceed the bucket width {width}; raise it")
        hi = vocab if vocab is not None else 2**31 - 1
        if any(not 0 <= t < hi for t in ids):
            raise ValueError(f"row {i}: {name} {ids} must be in [0, {hi})")
    if r.allowed_ids and set(r.allowed_ids) <= set(r.suppressed_ids):
        raise ValueError(f"row {i}: every allowed id {r.allowed_ids} is also suppressed")
