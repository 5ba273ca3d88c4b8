"""Host-side scheduler: request queue, KV admission, prefill/decode batches, prefix cache.

Engine loop: `plan = scheduler.schedule()` -> `runner.run(plan)` -> `scheduler.commit(plan, ...)`.
One plan is in flight at a time: schedule() refuses to run before the previous plan is
committed. The scheduler never looks at token meanings; it decides which sequences run in a
step and where their KV lives.

Admission reserves KV for the whole request: prefix + prompt + max_new_tokens - 1 positions,
allocated as pages when the request leaves the queue. A running sequence therefore never
needs another page, so there is no preemption, no growth watermark and no deadlock: the pool
only drains as sequences finish, and a waiting request is admitted once enough pages are free
(or reclaimable from the prefix cache). We chose this over lazy growth with preemption because
the pool is large compared with what fits in a batch (an H100 with 40 GB of FP8 KV holds
~400k positions, vs 64 sequences x 4096 = 262k) and because recomputing a preempted sequence
would need its generated tokens, which only the engine knows. A request whose reservation
exceeds the whole pool is rejected at add() with KVCapacityError; others are unaffected.

Queue order: priority (lower first), then arrival time, then add() order. The head of the queue
blocks those behind it when KV is short (so large requests are not starved), except that a
request whose image is being prefilled by a running sequence waits one step for the prefix to
reach the cache instead of prefilling the same image again.

Steps: prefill has priority. A prefill step packs chunks of prefilling sequences in admission
order under the token budget (under `light_token_budget` while fewer than `light_below_decoding`
sequences decode); an uncached image prefix goes whole in one chunk, prompts may be split
anywhere. With `mixed_decode_buckets`, a prefill step also carries one decode position of
every decoding sequence when they fit the largest of those buckets (a mixed step: the weights
are read once for both, and decoding does not stall while images are prefilled). Otherwise a
decode step advances every decoding sequence by one position, or by up to `decode_steps`
positions (each capped by the sequence's remaining token budget) when the engine asks for a
multi-step launch.
Pure Python + numpy (no JAX).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

import numpy as np

from kestrel_jax.serving.buckets import pick_bucket
from kestrel_jax.serving.pages import PageAllocator, PageTables, pages_for
from kestrel_jax.serving.plan import DecodePlan, PrefillPlan, StepPlan
from kestrel_jax.serving.prefix_cache import MISS, PrefixCache, PrefixKeys, prefix_keys
from kestrel_jax.serving.request import (
    FINISH_CANCELLED,
    FINISH_DEADLINE,
    FINISH_LENGTH,
    DuplicateRequestError,
    FinishedRequest,
    InvalidRequestError,
    KVCapacityError,
    Request,
    RequestMetrics,
    SequenceTooLongError,
)
from kestrel_jax.serving.scheduler_config import SchedulerConfig, SchedulerStats


class SchedulerStateError(RuntimeError):
    """schedule()/commit() called out of order."""


@dataclass(eq=False)
class _Waiting:
    order: tuple[int, float, int]  # (priority, arrival, add counter)
    req: Request
    keys: PrefixKeys | None
    metrics: RequestMetrics


@dataclass(eq=False)
class _Seq:
    req: Request
    keys: PrefixKeys | None
    metrics: RequestMetrics
    pages: list[int]  # in position order; one reference held on each
    row: int  # page-table mirror row
    computed: int  # positions whose KV is written (or cached)
    prefills_image: bool  # image prefix missed the cache: this sequence computes it
    next_cache_page: int  # first page index not yet offered to the prefix cache
    generated: int = 0

    @property
    def decoding(self) -> bool:
        return self.computed >= self.req.prompt_total


class Scheduler:
    def __init__(self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.allocator = PageAllocator(config.num_pages, config.page_size)
        self.page_tables = PageTables(config.running_limit, config.max_pages_per_seq)
        self.prefix_cache = PrefixCache(self.allocator) if config.enable_prefix_cache else None
        self.stats = SchedulerStats()
        self._waiting: list[_Waiting] = []
        self._waiting_ids: set[Hashable] = set()
        self._live: dict[Hashable, _Seq] = {}  # insertion order = admission order
        self._finished: list[FinishedRequest] = []
        self._in_flight: StepPlan | None = None
        self._step = 0
        self._counter = 0

    # -- queries -----------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._live)

    def steps_to_first_finish(self, steps: int) -> int:
        """Decode iterations for a launch of up to `steps`: `steps`, or 1 when a decoding sequence
        reaches its max_new_tokens within fewer than `steps` tokens while another goes on. A
        launch of `steps` iterations would otherwise keep the finished sequence's batch slot (and
        the request its client sends next, or one waiting for the slot) idle until the launch
        ends; with a few sequences finishing at a time (64 clients asking again as each answer
        ends) the batch then runs well below full. The engine compiles 1 and `steps` iterations
        per launch, hence 1 (the following launches are capped again until the sequence is out)."""
        left = [s.req.max_new_tokens - s.generated for s in self._live.values() if s.decoding]
        if steps > 1 and left and min(left) < steps and min(left) < max(left):
            return 1
        return steps

    def has_work(self) -> bool:
        return bool(self._waiting or self._live)

    def running_ids(self) -> list[Hashable]:
        """Requests holding KV, in admission order."""
        return list(self._live)

    def waiting_ids(self) -> list[Hashable]:
        """Queued requests, in the order they will be considered."""
        return [w.req.request_id for w in self._waiting]

    def is_live(self, request_id: Hashable) -> bool:
        return request_id in self._live or request_id in self._waiting_ids

    def image_cached(self, request_id: Hashable) -> bool:
        """Whether a waiting request's image prefix is in the prefix cache now (its admission would
        then reuse it; the entry may still be evicted before that)."""
        if self.prefix_cache is None:
            return False
        w = next((w for w in self._waiting if w.req.request_id == request_id), None)
        key = w.keys.image_key if w is not None and w.keys is not None else None
        return key is not None and self.prefix_cache.contains_image(key)

    def take_finished(self) -> list[FinishedRequest]:
        """Requests that ended since the last call (engine-reported, length, cancel, deadline)."""
        out, self._finished = self._finished, []
        return out

    # -- requests ----------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        """Queues a request, or raises a RequestRejected subclass (and keeps nothing of it)."""
        try:
            self._validate(req)
        except Exception:
            self.stats.rejected += 1
            raise
        now = self.clock()
        arrival = now if req.arrival_time is None else req.arrival_time
        keys = None
        if self.prefix_cache is not None:
            keys = prefix_keys(self.config.page_size, req.prefix_len, req.image_digest, req.prompt_tokens)
        self._counter += 1
        w = _Waiting((req.priority, arrival, self._counter), req, keys, RequestMetrics(arrival, req.prompt_total))
        bisect.insort(self._waiting, w, key=lambda x: x.order)
        self._waiting_ids.add(req.request_id)

    def _validate(self, req: Request) -> None:
        cfg = self.config
        if self.is_live(req.request_id):
            raise DuplicateRequestError(f"request id {req.request_id!r} is already waiting or running")
        if req.prompt_len < 1:
            raise InvalidRequestError(f"{req.request_id!r}: prompt_len must be >= 1, got {req.prompt_len}")
        if req.max_new_tokens < 1:
            raise InvalidRequestError(f"{req.request_id!r}: max_new_tokens must be >= 1, got {req.max_new_tokens}")
        if req.prompt_tokens is not None and len(req.prompt_tokens) != req.prompt_len:
            raise InvalidRequestError(
                f"{req.request_id!r}: {len(req.prompt_tokens)} prompt_tokens but prompt_len={req.prompt_len}"
            )
        if (req.image_digest is None) != (req.prefix_len == 0):
            raise InvalidRequestError(
                f"{req.request_id!r}: an image request needs image_digest and prefix_len="
                f"{cfg.image_prefix_len}; a text-only one neither (got prefix_len={req.prefix_len})"
            )
        if req.image_digest is not None and (req.prefix_len != cfg.image_prefix_len or not req.image_digest):
            raise InvalidRequestError(
                f"{req.request_id!r}: image prefix_len must be {cfg.image_prefix_len} with a non-empty "
                f"digest, got {req.prefix_len}"
            )
        total = req.prompt_total + req.max_new_tokens
        if total > cfg.max_seq_len:
            raise SequenceTooLongError(
                f"{req.request_id!r}: prefix {req.prefix_len} + prompt {req.prompt_len} + max_new_tokens "
                f"{req.max_new_tokens} = {total} exceeds max_seq_len={cfg.max_seq_len}; shorten the "
                "prompt or lower max_new_tokens"
            )
        need = pages_for(req.max_positions, cfg.page_size)
        if need > cfg.num_pages:
            raise KVCapacityError(
                f"{req.request_id!r} needs {need} KV pages but the pool has {cfg.num_pages}; lower "
                "max_new_tokens or enlarge the KV pool"
            )

    def cancel(self, request_id: Hashable, reason: str = FINISH_CANCELLED) -> bool:
        """Ends a waiting or running request now and frees its pages; False if unknown.
        Safe while a plan is in flight: commit() ignores sequences that are gone."""
        now = self.clock()
        if request_id in self._waiting_ids:
            w = next(w for w in self._waiting if w.req.request_id == request_id)
            self._waiting.remove(w)
            self._waiting_ids.discard(request_id)
            self._record(w.req, reason, w.metrics, now)
            return True
        seq = self._live.get(request_id)
        if seq is None:
            return False
        self._release(seq, reason, now)
        return True

    # -- step --------------------------------------------------------------------------------

    def schedule(self, decode_steps: int = 1, ready: Callable[[Hashable], bool] | None = None) -> StepPlan | None:
        """Admits what fits and returns the next step's plan, or None when nothing can run.
        `decode_steps` > 1: a decode plan advances each sequence by up to that many positions
        in one launch (the engine asks for it only when every row can run ahead).
        `ready(request_id)`: whether a sequence whose next prefill chunk holds its image prefix has
        that image's encoding at hand. One that has not is held back this step (the sequences after
        it may prefill); if nothing else prefills, a one-iteration decode step runs instead so that
        the held-back prefill starts one short step later, and only with nothing to decode either
        is it scheduled anyway (the step's launch then waits for the encoding)."""
        if decode_steps < 1:
            raise ValueError(f"decode_steps must be >= 1, got {decode_steps}")
        if self._in_flight is not None:
            raise SchedulerStateError("commit() the plan in flight before scheduling another")
        now = self.clock()
        self._expire(now)
        self._admit(now)
        held: list[Hashable] = []
        plan: StepPlan | None = self._build_prefill(ready, held)
        if plan is None and held:
            plan = self._build_decode(1) or self._build_prefill()
            self.stats.deferred_prefills += isinstance(plan, DecodePlan)
        elif plan is None:
            plan = self._build_decode(decode_steps)
        self._in_flight = plan
        return plan

    def commit(self, plan: StepPlan, finished: Mapping[Hashable, str] | None = None) -> None:
        """Records that `plan` ran. `finished` maps request ids the engine ended in this step
        (EOS, stop, ...) to a reason; ids that are no longer live are ignored (e.g. cancelled
        meanwhile). Sequences reaching max_new_tokens end with reason "length"."""
        if plan is None or plan is not self._in_flight:
            raise SchedulerStateError("commit() must receive the plan returned by the last schedule()")
        self._in_flight = None
        if self.prefix_cache is not None:
            self.prefix_cache.copies_done()
        now = self.clock()
        stepped: list[_Seq] = []
        decode = plan.decode if isinstance(plan, PrefillPlan) else plan
        if isinstance(plan, PrefillPlan):
            cu = plan.cu_q_lens
            for b in range(plan.num_seqs):
                seq = self._live.get(plan.seq_ids[b])
                if seq is None:
                    continue
                seq.computed += int(cu[b + 1] - cu[b])
                self._offer_to_cache(seq)
                if seq.decoding:
                    seq.generated = 1
                    seq.metrics.first_token_time = now
                    stepped.append(seq)
        if decode is not None:
            for i, sid in enumerate(decode.seq_ids[: decode.num_seqs]):
                seq = self._live.get(sid)
                if seq is None:
                    continue
                n = decode.steps_of(i)
                seq.computed += n
                seq.generated += n
                stepped.append(seq)
        for sid, reason in (finished or {}).items():
            seq = self._live.get(sid)
            if seq is not None:
                self._release(seq, reason, now)
        for seq in stepped:
            if seq.generated >= seq.req.max_new_tokens and seq.req.request_id in self._live:
                self._release(seq, FINISH_LENGTH, now)

    # -- admission ---------------------------------------------------------------------------

    def _expire(self, now: float) -> None:
        for w in [w for w in self._waiting if w.req.deadline is not None and w.req.deadline <= now]:
            self._waiting.remove(w)
            self._waiting_ids.discard(w.req.request_id)
            self._record(w.req, FINISH_DEADLINE, w.metrics, now)
        for seq in [s for s in self._live.values() if s.req.deadline is not None and s.req.deadline <= now]:
            self._release(seq, FINISH_DEADLINE, now)

    def _admit(self, now: float) -> None:
        images_in_prefill = {s.keys.image_key for s in self._live.values() if s.prefills_image and s.keys is not None}
        i = 0
        while i < len(self._waiting) and len(self._live) < self.config.running_limit:
            w = self._waiting[i]
            if w.keys is not None and w.keys.image_key in images_in_prefill:
                i += 1  # its image reaches the cache after the running prefill commits
                continue
            seq = self._try_admit(w, now)
            if seq is None:
                break  # KV short: the head waits and blocks those behind it
            del self._waiting[i]
            self._waiting_ids.discard(w.req.request_id)
            if seq.prefills_image and seq.keys is not None:
                images_in_prefill.add(seq.keys.image_key)

    def _try_admit(self, w: _Waiting, now: float) -> _Seq | None:
        req, cache = w.req, self.prefix_cache
        total_pages = pages_for(req.max_positions, self.config.page_size)
        hit = cache.lookup(w.keys, req.prompt_total) if cache is not None and w.keys is not None else MISS
        own = total_pages - len(hit.shared_pages)
        if not self.allocator.can_allocate(own):
            if cache is not None:
                cache.release(hit)
            return None
        own_pages = self.allocator.allocate(own)
        if hit.copy_src is not None:
            assert cache is not None
            cache.add_copy(hit.copy_src, own_pages[0])
        pages = list(hit.shared_pages) + own_pages
        row = self.page_tables.assign(pages)
        w.metrics.admitted_time = now
        w.metrics.cached_tokens = hit.cached_len
        seq = _Seq(
            req=req,
            keys=w.keys,
            metrics=w.metrics,
            pages=pages,
            row=row,
            computed=hit.cached_len,
            prefills_image=req.prefix_len > 0 and hit.cached_len == 0,
            next_cache_page=len(hit.shared_pages),
        )
        self._live[req.request_id] = seq
        self.stats.admitted += 1
        self.stats.cached_tokens += hit.cached_len
        return seq

    def _offer_to_cache(self, seq: _Seq) -> None:
        """After a prefill chunk: cache the image prefix once complete, then every prompt page
        that is full and computed."""
        cache, keys = self.prefix_cache, seq.keys
        if cache is None or keys is None:
            return
        if seq.prefills_image and seq.computed >= seq.req.prefix_len:
            cache.insert_image(keys, seq.pages)
            seq.prefills_image = False
        ps = self.config.page_size
        full = min(seq.computed, seq.req.prompt_total) // ps  # pages [0, full) are full and computed
        start = max(seq.next_cache_page, keys.first_page)
        for i in range(start, min(full, keys.first_page + len(keys.page_keys))):
            cache.insert_page(keys.page_keys[i - keys.first_page], seq.pages[i], depth=i + 1)
        seq.next_cache_page = max(seq.next_cache_page, full)

    def _release(self, seq: _Seq, reason: str, now: float) -> None:
        del self._live[seq.req.request_id]
        self.allocator.decref(seq.pages)
        self.page_tables.release(seq.row)
        seq.metrics.generated_tokens = seq.generated
        self._record(seq.req, reason, seq.metrics, now)

    def _record(self, req: Request, reason: str, metrics: RequestMetrics, now: float) -> None:
        metrics.finished_time = now
        if reason == FINISH_CANCELLED:
            self.stats.cancelled += 1
        elif reason == FINISH_DEADLINE:
            self.stats.expired += 1
        else:
            self.stats.finished += 1
        self._finished.append(FinishedRequest(req.request_id, reason, metrics))

    def flush_copies(self) -> tuple[np.ndarray, int]:
        """The page copies pending now (an image prefix cached by the last commit: its straddling
        page copied to the cache's tail page), taken out of the next plan, as a plan's (copies,
        num_copies). The caller must run them before any later step, which a device stream does
        for copies dispatched before that step's launch: the engine dispatches them right after
        the launch whose commit made them, while it would otherwise wait for the device, instead of
        with the next step. Counted as done at once (sources unpinned, tails readable)."""
        if self._in_flight is not None:
            raise SchedulerStateError("flush_copies() between commit() and the next schedule() only")
        copies, n = self._copies()
        if self.prefix_cache is not None:
            self.prefix_cache.copies_done()
        return copies, n

    # -- plans -------------------------------------------------------------------------------

    def _copies(self) -> tuple[np.ndarray, int]:
        pairs = self.prefix_cache.take_copies() if self.prefix_cache is not None else []
        out = np.full((self.config.max_copies, 2), -1, dtype=np.int32)
        assert len(pairs) <= out.shape[0], f"{len(pairs)} page copies exceed max_copies"
        if pairs:
            out[: len(pairs)] = pairs
        return out, len(pairs)

    def step_token_budget(self) -> int:
        """New tokens the next prefill step may take: the token budget, or under light load (fewer
        than `light_below_decoding` sequences decoding) `light_token_budget`."""
        cfg = self.config
        if cfg.light_token_budget is None:
            return cfg.token_budget
        decoding = sum(1 for seq in self._live.values() if seq.decoding)
        return cfg.light_token_budget if decoding < cfg.light_below_decoding else cfg.token_budget

    def _build_prefill(self, ready: Callable[[Hashable], bool] | None = None,
                       held: list[Hashable] | None = None) -> PrefillPlan | None:
        """`ready` / `held`: see `schedule`; the ids of the sequences held back go to `held`."""
        cfg = self.config
        full = self.step_token_budget()
        budget = full
        chosen: list[tuple[_Seq, int]] = []
        for seq in self._live.values():
            if seq.decoding:
                continue
            if len(chosen) == cfg.max_prefill_seqs or budget == 0:
                break
            n = min(seq.req.prompt_total - seq.computed, budget)
            if seq.computed < seq.req.prefix_len and seq.computed + n < seq.req.prefix_len:
                continue  # the bidirectional prefix cannot be split; wait for a fuller budget
            if ready is not None and seq.computed < seq.req.prefix_len and not ready(seq.req.request_id):
                if held is not None:
                    held.append(seq.req.request_id)
                continue  # its image encoding is not at hand yet
            chosen.append((seq, n))
            budget -= n
        if not chosen:
            return None
        B, P, ps = cfg.max_prefill_seqs, cfg.max_pages_per_seq, cfg.page_size
        num_tokens = full - budget
        T = pick_bucket(num_tokens, cfg.prefill_token_buckets)
        positions = np.zeros(T, np.int32)
        slots = np.full(T, -1, np.int32)
        token_seq = np.full(T, -1, np.int32)
        cu = np.zeros(B + 1, np.int32)
        kv_lens = np.zeros(B, np.int32)
        context = np.zeros(B, np.int32)
        prefix = np.zeros(B, np.int32)
        table = np.zeros((B, P), np.int32)
        logits_rows = np.full(B, -1, np.int32)
        seq_ids: list[Hashable | None] = [None] * B
        off = 0
        for b, (seq, n) in enumerate(chosen):
            pos = np.arange(seq.computed, seq.computed + n, dtype=np.int32)
            positions[off : off + n] = pos
            slots[off : off + n] = self.page_tables.slots(seq.row, pos, ps)
            token_seq[off : off + n] = b
            cu[b + 1 :] = off + n
            kv_lens[b] = seq.computed + n
            context[b] = seq.computed
            prefix[b] = seq.req.prefix_len
            table[b] = self.page_tables.table[seq.row]
            if seq.computed + n == seq.req.prompt_total:
                logits_rows[b] = off + n - 1
            seq_ids[b] = seq.req.request_id
            off += n
        decode = self._build_decode(1, mixed=True) if cfg.mixed_decode_buckets else None
        copies, num_copies = self._copies()
        self._step += 1
        self.stats.prefill_steps += 1
        self.stats.mixed_steps += decode is not None
        self.stats.prefill_tokens += num_tokens
        self.stats.prefill_padding += T - num_tokens
        return PrefillPlan(
            step=self._step, seq_ids=tuple(seq_ids), num_seqs=len(chosen), num_tokens=num_tokens,
            positions=positions, slots=slots, token_seq=token_seq, cu_q_lens=cu, kv_lens=kv_lens,
            context_lens=context, prefix_lens=prefix, page_table=table, logits_rows=logits_rows,
            copies=copies, num_copies=num_copies, decode=decode,
        )  # fmt: skip

    def _build_decode(self, steps: int = 1, mixed: bool = False) -> DecodePlan | None:
        """The decode plan of every decoding sequence; `mixed`: the decode rows of a prefill plan
        (None when they do not fit the largest mixed bucket; no page copies, no step of its own)."""
        cfg = self.config
        running = [s for s in self._live.values() if s.decoding]
        buckets = cfg.mixed_decode_buckets if mixed else cfg.decode_buckets
        if not running or len(running) > buckets[-1]:
            return None
        n = len(running)
        B = pick_bucket(n, buckets)
        rows = np.fromiter((s.row for s in running), np.int64, n)
        pos = np.fromiter((s.computed for s in running), np.int64, n)
        positions = np.zeros(B, np.int32)
        slots = np.full(B, -1, np.int32)
        kv_lens = np.zeros(B, np.int32)
        table = np.zeros((B, cfg.max_pages_per_seq), np.int32)
        table[:n] = self.page_tables.table[rows]
        positions[:n] = pos
        slots[:n] = table[np.arange(n), pos // cfg.page_size].astype(np.int64) * cfg.page_size + pos % cfg.page_size
        kv_lens[:n] = pos + 1
        seq_ids = tuple(s.req.request_id for s in running) + (None,) * (B - n)
        row_steps = None
        if steps > 1:  # each row runs ahead at most to the end of its reservation
            row_steps = np.zeros(B, np.int32)
            left = np.fromiter((s.req.max_new_tokens - s.generated for s in running), np.int64, n)
            row_steps[:n] = np.clip(left, 1, steps)
        if mixed:
            copies, num_copies = np.full((0, 2), -1, np.int32), 0
        else:
            copies, num_copies = self._copies()
            self._step += 1
            self.stats.decode_steps += 1
            self.stats.decode_iterations += steps
        self.stats.decode_rows += n if row_steps is None else int(row_steps.sum())
        self.stats.decode_padding += (B - n) * steps
        return DecodePlan(
            step=self._step, seq_ids=seq_ids, num_seqs=n, positions=positions, slots=slots,
            kv_lens=kv_lens, page_table=table, copies=copies, num_copies=num_copies, steps=steps,
            row_steps=row_steps,
        )  # fmt: skip

    # -- checks and teardown -----------------------------------------------------------------

    def check_invariants(self) -> None:
        """Page accounting and table consistency; raises PageAccountingError / AssertionError."""
        expected = np.zeros(self.config.num_pages, dtype=np.int32)
        for seq in self._live.values():
            np.add.at(expected, seq.pages, 1)
            assert self.page_tables.pages(seq.row).tolist() == seq.pages, f"table row of {seq.req.request_id!r}"
            assert seq.req.prefix_len <= seq.computed or seq.computed == 0, "partial image prefix"
            assert seq.computed <= seq.req.max_positions, f"{seq.req.request_id!r} ran past its reservation"
        assert len({s.row for s in self._live.values()}) == len(self._live), "two sequences share a row"
        assert self.page_tables.num_free_rows == self.config.running_limit - len(self._live)
        if self.prefix_cache is not None:
            self.prefix_cache.add_held_refs(expected)
        self.allocator.check_leaks(expected)

    def cancel_all(self) -> None:
        """Cancels every waiting and running request (shutdown / tests)."""
        for rid in [w.req.request_id for w in self._waiting] + list(self._live):
            self.cancel(rid)

    def clear_prefix_cache(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
