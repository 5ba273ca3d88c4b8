"""A device-free runner that "executes" step plans by checking them, for scheduler/engine tests.

It keeps a fake KV pool with one int64 per slot: the *content identity* of the KV a real model
would have written there. Identity models what KV depends on: image prefix position p ->
H(image digest, p) (the bidirectional prefix depends on the whole image only); later positions
-> H(identity at p - 1, input token at p), where the input is a prompt token (or a per-request
stand-in when the token ids are unknown) or the token the runner itself sampled. Every step
then checks, per sequence, that every position it reads (all of [0, kv_len)) holds exactly the
identity it should: wrong sharing, overwritten shared pages, missed page copies or stale cache
entries all show up as mismatches. It also checks the structural rules directly (positions
contiguous, slots inside the sequence's own pages, no slot written twice, no write into a page
the prefix cache holds, padding rows marked) and raises PlanViolation on the first failure.

Sampled tokens are a deterministic function of (request id, position). Pure numpy (no JAX).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from kestrel_jax.serving.pages import pages_for
from kestrel_jax.serving.plan import DecodePlan, PrefillPlan, StepPlan
from kestrel_jax.serving.request import FinishedRequest, Request
from kestrel_jax.serving.scheduler import Scheduler

_EMPTY = -1  # never-written slot
_TEXT_ROOT = 0x5EED


class PlanViolation(AssertionError):
    """A plan broke an invariant the device step relies on."""


def _mix(*parts: object) -> int:
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1  # non-negative int64


@dataclass(eq=False)
class _SeqState:
    req: Request
    ids: list[int] = field(default_factory=list)  # expected identity per position, grown lazily
    sampled: dict[int, int] = field(default_factory=dict)  # position -> token sampled from its logits
    next_pos: int = -1  # positions [0, next_pos) are in KV; -1 = not seen in a plan yet
    pages: tuple[int, ...] = ()  # the page-table row's pages, fixed for the sequence's life
    own_from: int = 0  # page index of the first page this sequence writes (earlier ones are shared)

    def identity(self, p: int) -> int:
        req = self.req
        while len(self.ids) <= p:
            q = len(self.ids)
            if q < req.prefix_len:
                self.ids.append(_mix("image", req.image_digest, q))
                continue
            prev = self.ids[q - 1] if q else _TEXT_ROOT
            if q < req.prompt_total:
                k = q - req.prefix_len
                tok = ("tok", req.prompt_tokens[k]) if req.prompt_tokens is not None else ("anon", req.request_id, q)
            else:
                if q - 1 not in self.sampled:
                    raise PlanViolation(f"{req.request_id!r}: position {q} fed before a token was sampled for it")
                tok = ("tok", self.sampled[q - 1])
            self.ids.append(_mix(prev, tok))
        return self.ids[p]


class FakeRunner:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        vocab_size: int = 51200,
        cached_pages: Callable[[], Iterable[int]] | None = None,
    ) -> None:
        self.num_pages, self.page_size, self.vocab_size = num_pages, page_size, vocab_size
        self.pool = np.full(num_pages * page_size, _EMPTY, dtype=np.int64)  # [num_pages * page_size]
        self._cached_pages = cached_pages
        self._seqs: dict[Hashable, _SeqState] = {}
        self._forgotten: set[Hashable] = set()
        self._holders: dict[int, set[Hashable]] = {}  # page -> sequences holding it
        self.steps = 0

    def register(self, req: Request) -> None:
        """Tell the runner what a request contains (the engine knows; plans carry only ids)."""
        self._seqs[req.request_id] = _SeqState(req)
        self._forgotten.discard(req.request_id)

    def forget(self, request_id: Hashable) -> None:
        """The request ended; plans already built may still name it (their rows are skipped)."""
        st = self._seqs.pop(request_id, None)
        if st is not None:
            for p in st.pages:
                self._holders[p].discard(request_id)
        self._forgotten.add(request_id)

    def token_for(self, request_id: Hashable, position: int) -> int:
        """The token this runner samples from the logits at `position` (deterministic)."""
        return _mix("sample", request_id, position) % self.vocab_size

    # -- execution ---------------------------------------------------------------------------

    def run(self, plan: StepPlan) -> np.ndarray:
        """Checks and applies the plan; returns sampled tokens [B] int32 ([K, B] for a K-step
        decode plan), -1 where none. A mixed plan's tokens follow `row_ids`: its decode rows, then
        its prefill sequences."""
        self.steps += 1
        protected = set(self._cached_pages()) if self._cached_pages is not None else set()
        self._apply_copies(plan.copies, plan.num_copies)
        if isinstance(plan, PrefillPlan):
            dec = plan.decode
            if dec is None:
                return self._run_prefill(plan, protected)
            both = {s for s in plan.seq_ids if s is not None} & {s for s in dec.seq_ids if s is not None}
            if both:
                raise PlanViolation(f"sequences {sorted(map(repr, both))} both prefill and decode in one step")
            return np.concatenate([self._run_decode(dec, protected), self._run_prefill(plan, protected)])
        return self._run_decode(plan, protected)

    def copy_pages(self, copies: np.ndarray, n: int) -> None:
        """Page copies dispatched on their own (`Scheduler.flush_copies`), before the next step."""
        self._apply_copies(copies, n)

    def _apply_copies(self, copies: np.ndarray, n: int) -> None:
        real, pad = copies[:n], copies[n:]
        if (pad != -1).any() or (real < 0).any() or (real >= self.num_pages).any():
            raise PlanViolation(f"bad copy rows: {copies.tolist()}")
        if len(set(real[:, 1].tolist())) != n or set(real[:, 0].tolist()) & set(real[:, 1].tolist()):
            raise PlanViolation(f"copies must have distinct destinations that are not sources: {real.tolist()}")
        ps = self.page_size
        src = self.pool.reshape(self.num_pages, ps)[real[:, 0]].copy()  # one gather, then one scatter
        self.pool.reshape(self.num_pages, ps)[real[:, 1]] = src

    def _state(self, sid: Hashable | None) -> _SeqState | None:
        if sid in self._forgotten:
            return None  # cancelled while its plan was in flight
        if sid not in self._seqs:
            raise PlanViolation(f"plan names unknown sequence {sid!r}")
        return self._seqs[sid]

    def _first_sight(self, st: _SeqState, row: np.ndarray, context: int) -> None:
        req, ps = st.req, self.page_size
        if context not in (0, req.prefix_len) and context % ps:
            raise PlanViolation(
                f"{req.request_id!r}: cached length {context} is neither 0, the prefix nor page-aligned"
            )
        if 0 < context < req.prefix_len:
            raise PlanViolation(f"{req.request_id!r}: partial image prefix {context} reused")
        st.pages = tuple(int(p) for p in row[: pages_for(req.max_positions, ps)])
        st.own_from = context // ps
        if len(set(st.pages)) != len(st.pages):
            raise PlanViolation(f"{req.request_id!r}: a page appears twice in its row {st.pages}")
        for i, p in enumerate(st.pages):
            others = self._holders.setdefault(p, set())
            if i >= st.own_from and others:
                raise PlanViolation(f"{req.request_id!r}: own page {p} is also held by {sorted(map(repr, others))}")
            others.add(req.request_id)
        st.next_pos = context

    def _check_row(self, st: _SeqState, row: np.ndarray, kv_len: int) -> None:
        n = pages_for(kv_len, self.page_size)
        if tuple(int(p) for p in row[:n]) != st.pages[:n]:
            raise PlanViolation(f"{st.req.request_id!r}: page-table row changed: {row[:n].tolist()} vs {st.pages[:n]}")

    def _write(self, st: _SeqState, positions: np.ndarray, slots: np.ndarray, protected: set[int]) -> None:
        rid, ps = st.req.request_id, self.page_size
        if positions.size and (positions[0] != st.next_pos or (np.diff(positions) != 1).any()):
            raise PlanViolation(f"{rid!r}: positions {positions[:4].tolist()}... do not continue from {st.next_pos}")
        if positions.size and positions[-1] >= st.req.max_positions:
            raise PlanViolation(f"{rid!r}: position {int(positions[-1])} is past its reservation")
        table = np.asarray(st.pages, dtype=np.int64)
        expect = table[positions // ps] * ps + positions % ps
        if not np.array_equal(expect, slots):
            raise PlanViolation(f"{rid!r}: slots {slots.tolist()} are not its pages' slots {expect.tolist()}")
        pages = set((slots // ps).tolist())
        if any(st.pages.index(p) < st.own_from for p in pages):
            raise PlanViolation(f"{rid!r}: writes into a shared prefix page")
        if pages & protected:
            raise PlanViolation(f"{rid!r}: writes into prefix-cache pages {sorted(pages & protected)}")
        self.pool[slots] = [st.identity(int(p)) for p in positions]
        st.next_pos += positions.size

    def _check_reads(self, st: _SeqState, kv_len: int) -> None:
        pos = np.arange(kv_len)
        table = np.asarray(st.pages, dtype=np.int64)
        got = self.pool[table[pos // self.page_size] * self.page_size + pos % self.page_size]
        st.identity(kv_len - 1)
        want = np.array(st.ids[:kv_len], dtype=np.int64)
        bad = np.flatnonzero(got != want)
        if bad.size:
            raise PlanViolation(
                f"{st.req.request_id!r}: KV at positions {bad[:8].tolist()} is not this sequence's "
                f"({'never written' if (got[bad] == _EMPTY).all() else 'foreign or stale content'})"
            )

    def _sample(self, st: _SeqState, position: int) -> int:
        if len(st.sampled) >= st.req.max_new_tokens:
            raise PlanViolation(f"{st.req.request_id!r}: more than max_new_tokens={st.req.max_new_tokens} sampled")
        tok = self.token_for(st.req.request_id, position)
        st.sampled[position] = tok
        return tok

    def _run_prefill(self, plan: PrefillPlan, protected: set[int]) -> np.ndarray:
        B, T = len(plan.seq_ids), plan.bucket
        cu, nt, ns = plan.cu_q_lens, plan.num_tokens, plan.num_seqs
        if cu[0] != 0 or (np.diff(cu) < 0).any() or cu[ns] != nt or (cu[ns:] != nt).any() or nt > T:
            raise PlanViolation(f"bad cu_q_lens {cu.tolist()} for {nt} tokens")
        if (plan.slots[nt:] != -1).any() or (plan.token_seq[nt:] != -1).any():
            raise PlanViolation("padding rows must have slot -1 and token_seq -1")
        if any(s is not None for s in plan.seq_ids[ns:]) or (plan.kv_lens[ns:] != 0).any():
            raise PlanViolation("padding sequences must have seq_id None and kv_len 0")
        real_slots = plan.slots[:nt]
        if np.unique(real_slots).size != nt or (real_slots < 0).any():
            raise PlanViolation("two rows write the same slot (or a real row has slot -1)")
        tokens = np.full(B, -1, dtype=np.int32)
        for b in range(ns):
            lo, hi = int(cu[b]), int(cu[b + 1])
            kv, ctx = int(plan.kv_lens[b]), int(plan.context_lens[b])
            if (plan.token_seq[lo:hi] != b).any() or kv - ctx != hi - lo or hi == lo:
                raise PlanViolation(f"sequence {b}: rows [{lo}, {hi}) disagree with kv_len {kv} / context {ctx}")
            st = self._state(plan.seq_ids[b])
            if st is None:
                continue
            req = st.req
            if plan.prefix_lens[b] != req.prefix_len or kv > req.prompt_total:
                raise PlanViolation(f"{req.request_id!r}: prefix_len/kv_len do not match the request")
            if ctx < req.prefix_len and (ctx != 0 or kv < req.prefix_len):
                raise PlanViolation(f"{req.request_id!r}: image prefix split across chunks ({ctx} -> {kv})")
            if st.next_pos < 0:
                self._first_sight(st, plan.page_table[b], ctx)
            self._check_row(st, plan.page_table[b], kv)
            self._write(st, plan.positions[lo:hi], plan.slots[lo:hi], protected)
            self._check_reads(st, kv)
            completes = kv == req.prompt_total
            if plan.logits_rows[b] != (hi - 1 if completes else -1):
                raise PlanViolation(
                    f"{req.request_id!r}: logits row {plan.logits_rows[b]} (prompt complete: {completes})"
                )
            if completes:
                tokens[b] = self._sample(st, kv - 1)
        return tokens

    def _run_decode(self, plan: DecodePlan, protected: set[int]) -> np.ndarray:
        B, n = plan.bucket, plan.num_seqs
        if (
            any(s is not None for s in plan.seq_ids[n:])
            or (plan.slots[n:] != -1).any()
            or (plan.kv_lens[n:] != 0).any()
        ):
            raise PlanViolation("padding decode rows must have seq_id None, slot -1 and kv_len 0")
        if np.unique(plan.slots[:n]).size != n:
            raise PlanViolation("two decode rows write the same slot")
        if len(set(plan.seq_ids[:n])) != n:
            raise PlanViolation("a sequence appears twice in one decode step")
        K, ps = plan.steps, self.page_size
        tokens = np.full((K, B), -1, dtype=np.int32)
        for i in range(n):
            st = self._state(plan.seq_ids[i])
            if st is None:
                continue
            pos, kv = int(plan.positions[i]), int(plan.kv_lens[i])
            if st.next_pos < st.req.prompt_total or pos != st.next_pos or kv != pos + 1:
                raise PlanViolation(f"{st.req.request_id!r}: decode at {pos} (kv_len {kv}) but KV holds {st.next_pos}")
            steps = plan.steps_of(i)
            if not 1 <= steps <= K:
                raise PlanViolation(f"{st.req.request_id!r}: {steps} iterations in a {K}-step launch")
            for j in range(steps):  # later iterations: slot from the page-table row (as on the device)
                p = pos + j
                slot = int(plan.slots[i]) if j == 0 else int(plan.page_table[i, p // ps]) * ps + p % ps
                self._check_row(st, plan.page_table[i], p + 1)
                self._write(st, np.array([p]), np.array([slot]), protected)
                self._check_reads(st, p + 1)
                tokens[j, i] = self._sample(st, p)
        return tokens[0] if K == 1 else tokens


def sampled(plan: StepPlan, tokens: np.ndarray) -> Mapping[Hashable, list[int]]:
    """request id -> tokens (in order) for the sequences that got tokens from this step."""
    rows = tokens[None] if tokens.ndim == 1 else tokens  # [K, B]
    out: dict[Hashable, list[int]] = {}
    for i, sid in enumerate(plan.row_ids):
        toks = [int(t) for t in rows[:, i].tolist() if t >= 0]
        if sid is not None and toks:
            out[sid] = toks
    return out


@dataclass(frozen=True)
class StepOutcome:
    plan: StepPlan
    tokens: np.ndarray  # [B] (or [K, B] multi-step) int32 as returned by FakeRunner.run
    finished: list[FinishedRequest]  # everything that ended during this step's commit


def submit(scheduler: Scheduler, runner: FakeRunner, req: Request) -> None:
    """add() the request and register its content with the runner (nothing kept if rejected)."""
    scheduler.add(req)
    runner.register(req)


def run_step(
    scheduler: Scheduler, runner: FakeRunner, stop: Callable[[Hashable, int], bool] | None = None,
    decode_steps: int = 1, ready: Callable[[Hashable], bool] | None = None, flush_copies: bool = False,
) -> StepOutcome | None:
    """One engine iteration: schedule -> run -> commit. `stop(request_id, token)` marks a sampled
    token as the end of its request (reason "stop"). Ended requests are forgotten by the runner
    (cancels and deadline expiries from schedule() included) and returned. `ready`: the
    scheduler's image-readiness predicate (`Scheduler.schedule`). `flush_copies`: the page copies
    the commit made are run at once (`Scheduler.flush_copies`), as the engine does."""
    plan = scheduler.schedule(decode_steps, ready=ready)
    ended = scheduler.take_finished()  # cancels since the last step and deadline expiries
    for f in ended:
        runner.forget(f.request_id)  # before run: their pages may already be someone else's
    if plan is None:
        return None
    tokens = runner.run(plan)
    finished = {sid: "stop" for sid, toks in sampled(plan, tokens).items()
                if stop is not None and any(stop(sid, t) for t in toks)}
    scheduler.commit(plan, finished)
    if flush_copies:
        copies, n = scheduler.flush_copies()
        if n:
            runner.copy_pages(copies, n)
    done = scheduler.take_finished()
    for f in done:
        runner.forget(f.request_id)
    ended += done
    return StepOutcome(plan, tokens, ended)


def run_until_idle(
    scheduler: Scheduler,
    runner: FakeRunner,
    stop: Callable[[Hashable, int], bool] | None = None,
    max_steps: int = 100_000,
    decode_steps: int = 1,
    flush_copies: bool = False,
) -> list[FinishedRequest]:
    """Steps until nothing is waiting or running; returns everything that ended."""
    ended: list[FinishedRequest] = []
    for _ in range(max_steps):
        out = run_step(scheduler, runner, stop, decode_steps, flush_copies=flush_copies)
        if out is None:
            if scheduler.has_work():
                raise RuntimeError("scheduler has work but planned nothing (deadlock)")
            return ended
        ended += out.finished
    raise RuntimeError(f"still busy after {max_steps} steps")


def assert_released(scheduler: Scheduler) -> None:
    """Teardown check: after cancelling everything and clearing the prefix cache, every page is
    free and the accounting is consistent."""
    scheduler.cancel_all()
    scheduler.clear_prefix_cache()
    scheduler.check_invariants()
    if scheduler.allocator.num_used:
        raise AssertionError(f"{scheduler.allocator.num_used} KV pages leaked")
