"""Scheduler: validation, ordering, KV admission, cancellation, deadlines, chunked prefill, decode
buckets, step protocol, and a randomized soak through the FakeRunner (which checks every plan)."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Hashable, Iterator

import numpy as np
import pytest

from kestrel_jax.serving.fake_runner import (
    FakeRunner,
    assert_released,
    run_step,
    run_until_idle,
    sampled,
    submit,
)
from kestrel_jax.serving.plan import DecodePlan, PrefillPlan
from kestrel_jax.serving.request import (
    DuplicateRequestError,
    InvalidRequestError,
    KVCapacityError,
    Request,
    RequestRejected,
    SequenceTooLongError,
)
from kestrel_jax.serving.scheduler import Scheduler, SchedulerStateError
from kestrel_jax.serving.scheduler_config import SchedulerConfig

PRE = 730


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


Make = Callable[..., tuple[Scheduler, FakeRunner, Clock]]


@pytest.fixture
def make() -> Iterator[Make]:
    """Builds schedulers; after the test checks their accounting and that cancelling everything
    and clearing the cache leaves zero pages in use."""
    made: list[Scheduler] = []

    def _make(**kw: object) -> tuple[Scheduler, FakeRunner, Clock]:
        args: dict = dict(
            num_pages=256, page_size=64, max_seq_len=4096, decode_buckets=(1, 2, 4, 8), max_running=8,
            prefill_token_buckets=(64, 256, 512, 768, 1024), max_prefill_seqs=4,
        )  # fmt: skip
        args.update(kw)
        clock = Clock()
        s = Scheduler(SchedulerConfig(**args), clock=clock)
        made.append(s)
        cached = s.prefix_cache.cached_pages if s.prefix_cache is not None else None
        return s, FakeRunner(s.config.num_pages, s.config.page_size, cached_pages=cached), clock

    yield _make
    for s in made:
        s.check_invariants()
        assert_released(s)


def text(rid: Hashable, n: int, max_new: int = 4, **kw: object) -> Request:
    return Request(rid, n, max_new, **kw)  # type: ignore[arg-type]


def image(rid: Hashable, name: str, n: int = 10, max_new: int = 4, **kw: object) -> Request:
    digest = hashlib.sha256(name.encode()).digest()
    return Request(rid, n, max_new, image_digest=digest, prefix_len=PRE, **kw)  # type: ignore[arg-type]


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="one chunk"):
        SchedulerConfig(num_pages=10, prefill_token_buckets=(256, 512), prefill_token_budget=512)
    with pytest.raises(ValueError, match="decode bucket"):
        SchedulerConfig(num_pages=10, decode_buckets=(1, 2, 4), max_running=8)
    with pytest.raises(ValueError, match="power of two"):
        SchedulerConfig(num_pages=10, page_size=48)
    with pytest.raises(ValueError, match="largest prefill"):
        SchedulerConfig(num_pages=10, prefill_token_budget=4096)
    cfg = SchedulerConfig(num_pages=10)
    assert cfg.max_running == cfg.decode_buckets[-1] and cfg.prefill_token_budget == cfg.prefill_token_buckets[-1]


def test_add_rejects_bad_requests_alone(make: Make) -> None:
    s, r, _ = make(num_pages=20, max_seq_len=2048)
    submit(s, r, text("ok1", 10))
    bad = [
        (SequenceTooLongError, text("long", 2000, max_new=100)),
        (KVCapacityError, text("huge", 1000, max_new=500)),  # 1499 positions = 24 pages > 20
        (DuplicateRequestError, text("ok1", 5)),
        (InvalidRequestError, text("empty", 0)),
        (InvalidRequestError, text("nogen", 5, max_new=0)),
        (InvalidRequestError, Request("noimg", 5, 2, prefix_len=PRE)),
        (InvalidRequestError, Request("noprefix", 5, 2, image_digest=b"x")),
        (InvalidRequestError, Request("badpre", 5, 2, image_digest=b"x", prefix_len=100)),
        (InvalidRequestError, text("toks", 5, prompt_tokens=(1, 2))),
    ]
    for err, req in bad:
        with pytest.raises(err):
            s.add(req)
        assert issubclass(err, RequestRejected)
    submit(s, r, text("ok2", 10))
    ended = run_until_idle(s, r)
    assert sorted(str(f.request_id) for f in ended) == ["ok1", "ok2"]
    assert s.stats.rejected == len(bad)


def test_fifo_within_priority(make: Make) -> None:
    s, r, clock = make(max_prefill_seqs=8, max_running=8)
    for i, prio in enumerate([1, 0, 1, 0, 0, 2]):
        clock.t = float(i)
        submit(s, r, text(f"r{i}", 10, priority=prio))
    submit(s, r, text("early", 10, priority=1, arrival_time=-5.0))
    out = run_step(s, r)
    assert out is not None and isinstance(out.plan, PrefillPlan)
    assert out.plan.seq_ids[: out.plan.num_seqs] == ("r1", "r3", "r4", "early", "r0", "r2", "r5")
    run_until_idle(s, r)


def test_admission_waits_for_kv_and_never_exceeds_the_pool(make: Make) -> None:
    # Each request reserves 4 pages of 16 (40 prompt + 20 new - 1 = 59 positions); 10 pages fit 2.
    s, r, _ = make(num_pages=10, page_size=16, enable_prefix_cache=False)
    for i in range(5):
        submit(s, r, text(i, 40, max_new=20))
    peak = 0
    while run_step(s, r) is not None:
        peak = max(peak, s.num_running)
        assert s.allocator.num_used <= 10
        s.check_invariants()
    assert peak == 2 and s.stats.finished == 5


def test_head_of_queue_is_not_starved_by_smaller_requests(make: Make) -> None:
    s, r, _ = make(num_pages=10, page_size=16, enable_prefix_cache=False)
    submit(s, r, text("small0", 20, max_new=60))  # 5 pages, long decode
    run_step(s, r)
    submit(s, r, text("big", 100, max_new=29))  # 8 pages: must wait for small0
    submit(s, r, text("small1", 10, max_new=2))  # 1 page: would fit, but queues behind big
    order = []
    while (out := run_step(s, r)) is not None:
        if isinstance(out.plan, PrefillPlan):
            order += [sid for sid in out.plan.seq_ids[: out.plan.num_seqs] if sid not in order]
    assert order == ["big", "small1"]


def test_kv_exhaustion_fails_only_the_oversized_request(make: Make) -> None:
    s, r, _ = make(num_pages=14, enable_prefix_cache=False)
    submit(s, r, image("a", "cat"))
    with pytest.raises(KVCapacityError, match="pool has 14"):
        s.add(image("huge", "cat", n=100, max_new=200))  # 1029 positions = 17 pages
    submit(s, r, image("b", "dog"))
    ended = run_until_idle(s, r)
    assert sorted(str(f.request_id) for f in ended) == ["a", "b"]


def test_cancel_waiting_mid_prefill_mid_decode_and_in_flight(make: Make) -> None:
    s, r, _ = make(prefill_token_budget=768, max_running=2, enable_prefix_cache=False)
    submit(s, r, text("long", 2000))  # three chunks
    submit(s, r, text("dec", 5, max_new=100))
    submit(s, r, text("wait", 5))  # max_running=2: waits
    run_step(s, r)  # first chunk of "long"
    assert s.cancel("wait") and s.cancel("long")
    assert not s.cancel("long") and not s.cancel("nobody")
    out = run_step(s, r)  # prefill of "dec"; run_step hands over (and forgets) what ended
    assert out is not None and {(f.request_id, f.reason) for f in out.finished} == {
        ("wait", "cancelled"),
        ("long", "cancelled"),
    }
    run_step(s, r)  # one decode
    assert s.cancel("dec")
    assert s.allocator.num_used == 0 and not s.has_work()
    assert [(f.request_id, f.reason) for f in s.take_finished()] == [("dec", "cancelled")]
    r.forget("dec")
    # Cancelled while its plan is in flight: the step still runs, commit ignores the sequence.
    submit(s, r, text("x", 5, max_new=50))
    submit(s, r, text("y", 5, max_new=3))
    run_step(s, r)
    plan = s.schedule()
    assert isinstance(plan, DecodePlan) and "x" in plan.seq_ids
    s.cancel("x")
    r.forget("x")
    r.run(plan)
    s.commit(plan, {"x": "stop"})  # a late report for a cancelled id is ignored
    ended = run_until_idle(s, r)
    assert [(f.request_id, f.reason) for f in ended] == [("x", "cancelled"), ("y", "length")]


def test_deadlines_expire_waiting_and_running(make: Make) -> None:
    s, r, clock = make(max_running=1, enable_prefix_cache=False)
    submit(s, r, text("run", 5, max_new=100, deadline=10.0))
    submit(s, r, text("queued", 5, deadline=5.0))
    submit(s, r, text("later", 5, max_new=2))
    for _ in range(3):
        clock.t += 1.0
        run_step(s, r)
    clock.t = 6.0
    out = run_step(s, r)
    assert out is not None and [(f.request_id, f.reason) for f in out.finished] == [("queued", "deadline")]
    clock.t = 10.0
    out = run_step(s, r)  # "run" expires mid-decode, "later" is admitted in the same schedule()
    assert out is not None and ("run", "deadline") in [(f.request_id, f.reason) for f in out.finished]
    assert isinstance(out.plan, PrefillPlan) and out.plan.seq_ids[0] == "later"
    run_until_idle(s, r)
    assert s.stats.expired == 2


def test_chunked_prefill_of_a_long_text_prompt(make: Make) -> None:
    s, r, _ = make(prefill_token_budget=768, prefill_token_buckets=(256, 512, 768))
    submit(s, r, text("t", 2000, prompt_tokens=tuple(range(2000))))
    chunks = []
    for _ in range(3):
        out = run_step(s, r)
        assert out is not None and isinstance(out.plan, PrefillPlan)
        p = out.plan
        chunks.append((int(p.context_lens[0]), int(p.kv_lens[0]), p.bucket, int(p.logits_rows[0])))
        assert p.positions[: p.num_tokens].tolist() == list(range(p.context_lens[0], p.kv_lens[0]))
    assert chunks == [(0, 768, 768, -1), (768, 1536, 768, -1), (1536, 2000, 512, 463)]
    out = run_step(s, r)
    assert out is not None and isinstance(out.plan, DecodePlan) and out.plan.positions[0] == 2000
    run_until_idle(s, r)


def test_image_prefix_is_never_split(make: Make) -> None:
    s, r, _ = make(prefill_token_budget=1024)
    submit(s, r, text("t", 500))
    submit(s, r, image("i", "cat", n=10))
    submit(s, r, text("u", 100))
    out = run_step(s, r)
    assert out is not None and isinstance(out.plan, PrefillPlan)
    # "i" (740 tokens) does not fit the 524 left; "u" behind it does.
    assert out.plan.seq_ids[: out.plan.num_seqs] == ("t", "u")
    out = run_step(s, r)
    assert out is not None and isinstance(out.plan, PrefillPlan)
    assert out.plan.seq_ids[0] == "i" and (out.plan.context_lens[0], out.plan.kv_lens[0]) == (0, 740)
    assert out.plan.prefix_lens[0] == PRE
    run_until_idle(s, r)


def test_decode_batches_are_padded_to_buckets(make: Make) -> None:
    s, r, _ = make(max_prefill_seqs=8)
    for i in range(5):
        submit(s, r, text(i, 3 + i, max_new=3))
    run_step(s, r)
    out = run_step(s, r)
    assert out is not None and isinstance(out.plan, DecodePlan)
    p = out.plan
    assert p.bucket == 8 and p.num_seqs == 5 and p.seq_ids[5:] == (None,) * 3
    assert p.slots[5:].tolist() == [-1] * 3 and p.kv_lens[5:].tolist() == [0] * 3
    assert p.positions[:5].tolist() == [3, 4, 5, 6, 7] and (p.kv_lens[:5] == p.positions[:5] + 1).all()
    assert p.page_table.shape == (8, s.config.max_pages_per_seq) and p.page_table.dtype == np.int32
    assert not p.slots.flags.writeable
    assert len(sampled(p, out.tokens)) == 5
    run_until_idle(s, r)
    assert s.stats.decode_padding == 3 * s.stats.decode_steps


def test_step_protocol_is_enforced(make: Make) -> None:
    s, r, _ = make()
    assert s.schedule() is None
    with pytest.raises(SchedulerStateError):
        s.commit(None)  # type: ignore[arg-type]
    submit(s, r, text("a", 5))
    plan = s.schedule()
    assert plan is not None
    with pytest.raises(SchedulerStateError):
        s.schedule()
    other = plan.__class__(**{**plan.__dict__, "step": 99})
    with pytest.raises(SchedulerStateError):
        s.commit(other)
    r.run(plan)
    s.commit(plan)
    run_until_idle(s, r)


def test_engine_finishes_and_metrics(make: Make) -> None:
    s, r, clock = make()
    clock.t = 1.0
    submit(s, r, text("eos", 5, max_new=50))
    submit(s, r, text("len", 5, max_new=3))
    submit(s, r, image("img", "cat", max_new=5))
    clock.t = 3.0
    ended: dict[Hashable, object] = {}
    counts: Counter[Hashable] = Counter()

    def stop(sid: Hashable, tok: int) -> bool:
        counts[sid] += 1
        return sid == "eos" and counts[sid] == 2

    while (out := run_step(s, r, stop=stop)) is not None:
        clock.t += 1.0
        ended.update({f.request_id: f for f in out.finished})
    eos, ln, img = ended["eos"], ended["len"], ended["img"]
    assert (eos.reason, eos.metrics.generated_tokens) == ("stop", 2)  # type: ignore[attr-defined]
    assert (ln.reason, ln.metrics.generated_tokens) == ("length", 3)  # type: ignore[attr-defined]
    assert img.metrics.queue_time == 2.0 and img.metrics.prompt_tokens == PRE + 10  # type: ignore[attr-defined]
    assert img.metrics.time_to_first_token == 2.0  # type: ignore[attr-defined]
    submit(s, r, image("img2", "cat"))
    ended2 = run_until_idle(s, r)
    assert ended2[0].metrics.cached_tokens == PRE


def _soak(seed: int, page_size: int, steps_cap: int = 20_000, multi_step: bool = False,
          mixed: tuple[int, ...] = (), light: bool = False) -> None:
    rng = np.random.default_rng(seed)

    def k() -> int:  # decode iterations asked for this step
        return int(rng.choice([1, 3, 8])) if multi_step else 1

    clock = Clock()
    s = Scheduler(
        SchedulerConfig(
            num_pages=60 if page_size == 64 else 240, page_size=page_size, max_seq_len=1024,
            decode_buckets=(1, 2, 4, 8), max_running=8, prefill_token_buckets=(256, 512, 768, 1024),
            max_prefill_seqs=4, mixed_decode_buckets=mixed,
            light_token_budget=768 if light else None, light_below_decoding=4,
        ),
        clock=clock,
    )  # fmt: skip
    assert s.prefix_cache is not None
    r = FakeRunner(s.config.num_pages, page_size, cached_pages=s.prefix_cache.cached_pages)
    # Shared templates make prefix-cache hits; the 600-token one is chunked when the budget is shared
    # (text only: it does not fit after an image within max_seq_len).
    templates = [tuple(rng.integers(0, 50000, size=n).tolist()) for n in (8, 45, 90, 600)]
    submitted, ended, rejected = set(), [], 0
    stops: set[Hashable] = set()
    n_req = 0
    for _ in range(steps_cap):
        clock.t += 1.0
        if n_req < 300 and rng.random() < 0.5:
            for _ in range(int(rng.integers(1, 3))):
                n_req += 1
                tail = tuple(rng.integers(0, 50000, size=int(rng.integers(1, 40))).tolist())
                is_image = rng.random() < 0.6
                t = int(rng.integers(3 if is_image else 4))
                toks = templates[t] + tail if rng.random() < 0.8 else None
                n = len(toks) if toks is not None else int(rng.integers(1, 300))
                new = int(rng.integers(1, 40)) if rng.random() > 0.02 else 900  # 900: rejected
                kw: dict[str, object] = dict(
                    prompt_tokens=toks, priority=int(rng.integers(0, 2)),
                    deadline=clock.t + float(rng.integers(5, 80)) if rng.random() < 0.1 else None,
                )  # fmt: skip
                if is_image:
                    req = image(n_req, f"img{rng.integers(4)}", n, new, **kw)
                else:
                    req = text(n_req, n, new, **kw)
                try:
                    submit(s, r, req)
                    submitted.add(n_req)
                except RequestRejected:
                    rejected += 1
        if s.num_running and rng.random() < 0.04:
            s.cancel(s.running_ids()[int(rng.integers(s.num_running))])
        if rng.random() < 0.02 and s.num_waiting:
            s.cancel(s.waiting_ids()[-1])
        for f in s.take_finished():
            r.forget(f.request_id)
            ended.append(f)
        if rng.random() < 0.05:  # cancel a sequence while its plan is in flight
            plan = s.schedule(k())
            if plan is not None:
                victims = [sid for sid in plan.row_ids if sid is not None]
                s.cancel(victims[0])
                r.forget(victims[0])
                r.run(plan)
                s.commit(plan)
            out_finished = s.take_finished()
        else:
            out = run_step(s, r, stop=lambda sid, tok: tok % 23 == 0, decode_steps=k())
            out_finished = out.finished if out is not None else s.take_finished()
        for f in out_finished:
            r.forget(f.request_id)
        ended += out_finished
        stops |= {f.request_id for f in out_finished if f.reason == "stop"}
        s.check_invariants()
        if n_req >= 300 and not s.has_work():
            break
    else:
        raise AssertionError("soak did not drain")
    ids = [f.request_id for f in ended]
    assert len(ids) == len(set(ids)) and set(ids) == submitted, "every request ends exactly once"
    assert rejected > 0 and stops and s.stats.cached_tokens > 0 and s.stats.expired > 0
    assert s.prefix_cache.stats.evicted_pages > 0
    if mixed:  # mixed steps ran, and (with a bucket below max_running) prefill-only steps too
        assert s.stats.mixed_steps > 0
        assert s.stats.mixed_steps < s.stats.prefill_steps or mixed[-1] >= 8
    assert_released(s)


@pytest.mark.parametrize(("seed", "page_size", "multi_step", "mixed", "light"),
                         [(0, 64, False, (), False), (1, 16, False, (), False), (2, 16, True, (), False),
                          (3, 64, False, (2, 8), False), (4, 16, True, (4,), False), (8, 64, True, (8,), True)])
def test_randomized_soak(seed: int, page_size: int, multi_step: bool, mixed: tuple[int, ...], light: bool) -> None:
    _soak(seed, page_size, multi_step=multi_step, mixed=mixed, light=light)


def test_mixed_steps_advance_decoding_sequences_during_a_prefill(make: Make) -> None:
    s, r, _ = make(mixed_decode_buckets=(2, 4))
    submit(s, r, text("a", 30, max_new=10))
    submit(s, r, text("b", 12, max_new=10))
    out = run_step(s, r)  # both prefill: nothing decodes yet
    assert out is not None and isinstance(out.plan, PrefillPlan) and out.plan.decode is None
    submit(s, r, image("c", "cat", max_new=3))
    out = run_step(s, r)
    assert out is not None and isinstance(out.plan, PrefillPlan)
    p, dec = out.plan, out.plan.decode
    assert dec is not None and dec.bucket == 2 and dec.num_seqs == 2 and dec.num_copies == 0
    assert dec.positions.tolist() == [30, 12] and dec.kv_lens.tolist() == [31, 13]
    assert p.row_ids == ("a", "b", "c", None, None, None)
    got = sampled(p, out.tokens)
    assert got == {"a": [r.token_for("a", 30)], "b": [r.token_for("b", 12)], "c": [r.token_for("c", PRE + 9)]}
    assert s.stats.mixed_steps == 1 and s.stats.decode_rows == 2 and s.stats.decode_steps == 0
    for rid in "def":  # three more prompts while a, b and c decode: 3 decode rows pad to bucket 4
        submit(s, r, text(rid, 5, max_new=2))
    out = run_step(s, r)
    assert out is not None and isinstance(out.plan, PrefillPlan) and out.plan.decode is not None
    assert out.plan.decode.bucket == 4 and out.plan.decode.seq_ids == ("a", "b", "c", None)
    out = run_step(s, r)  # six decoding: more than the largest mixed bucket, so a plain decode step
    assert out is not None and isinstance(out.plan, DecodePlan) and out.plan.num_seqs == 6
    run_until_idle(s, r)
    assert s.stats.finished == 6


def test_a_sequence_cancelled_while_its_mixed_step_is_in_flight(make: Make) -> None:
    s, r, _ = make(mixed_decode_buckets=(4,))
    submit(s, r, text("a", 20, max_new=6))
    run_step(s, r)
    submit(s, r, text("b", 20, max_new=6))
    plan = s.schedule()
    assert isinstance(plan, PrefillPlan) and plan.decode is not None and plan.decode.seq_ids[0] == "a"
    s.cancel("a")
    r.forget("a")
    r.run(plan)
    s.commit(plan)
    assert [f.request_id for f in s.take_finished()] == ["a"]
    ended = run_until_idle(s, r)
    assert [(f.request_id, f.reason, f.metrics.generated_tokens) for f in ended] == [("b", "length", 6)]


def test_multi_step_decode_runs_ahead_within_each_budget(make: Make) -> None:
    s, r, _ = make(page_size=16)
    submit(s, r, text("a", 30, max_new=20))  # 19 decode tokens after the prefill's first
    submit(s, r, text("b", 14, max_new=4))  # 3: fewer than one launch
    run_step(s, r, decode_steps=8)  # prefill both
    out = run_step(s, r, decode_steps=8)
    assert out is not None and isinstance(out.plan, DecodePlan)
    p = out.plan
    assert p.steps == 8 and p.row_steps is not None and p.row_steps.tolist() == [8, 3]
    assert out.tokens.shape == (8, 2) and (out.tokens[3:, 1] == -1).all()  # b stopped after 3
    assert {f.request_id: f.reason for f in out.finished} == {"b": "length"}
    assert sampled(p, out.tokens)["a"] == [r.token_for("a", 30 + j) for j in range(8)]
    out = run_step(s, r, decode_steps=8)  # a: positions 38..45, crossing page boundaries (16)
    assert out is not None and out.plan.steps_of(0) == 8  # type: ignore[union-attr]
    out = run_step(s, r, decode_steps=8)
    assert out is not None and out.plan.steps_of(0) == 3  # type: ignore[union-attr]
    assert [(f.request_id, f.reason, f.metrics.generated_tokens) for f in out.finished] == [("a", "length", 20)]
    assert s.stats.decode_rows == 8 + 3 + 8 + 3


def test_steps_to_first_finish(make: Make) -> None:
    s, r, _ = make(page_size=16)
    assert s.steps_to_first_finish(8) == 8  # nothing decoding
    submit(s, r, text("a", 30, max_new=20))  # 19 decode tokens after the prefill's first
    submit(s, r, text("b", 14, max_new=4))  # 3
    run_step(s, r, decode_steps=8)  # prefill both
    assert s.steps_to_first_finish(8) == 1  # b ends after 3 while a goes on: one at a time
    assert s.steps_to_first_finish(3) == 3 and s.steps_to_first_finish(1) == 1
    for left in (2, 1):
        out = run_step(s, r, decode_steps=s.steps_to_first_finish(8))
        assert out is not None and isinstance(out.plan, DecodePlan) and out.plan.steps == 1
        assert s.steps_to_first_finish(8) == 1, left
    out = run_step(s, r, decode_steps=s.steps_to_first_finish(8))
    assert out is not None and [f.request_id for f in out.finished] == ["b"]
    assert s.steps_to_first_finish(8) == 8  # a alone: its launch ends with it anyway
    while s.has_work():
        run_step(s, r, decode_steps=s.steps_to_first_finish(8))
    # two sequences ending together are not split either
    submit(s, r, text("c", 14, max_new=5))
    submit(s, r, text("d", 14, max_new=5))
    run_step(s, r, decode_steps=8)
    assert s.steps_to_first_finish(8) == 8
    while s.has_work():
        run_step(s, r, decode_steps=8)


def test_prefill_of_an_image_not_at_hand_is_held_back(make: Make) -> None:
    """`ready` says whether an image prefix's encoding is at hand: a sequence without it is held back
    while others prefill; with nothing else to prefill a one-iteration decode step runs (even where
    multi-step decode was asked for); with nothing to decode either it is scheduled anyway. Only
    sequences whose next chunk holds their image prefix are asked."""
    s, r, _ = make(mixed_decode_buckets=(2, 4))
    asked: list[Hashable] = []
    at_hand = {"c": False}

    def ready(rid: Hashable) -> bool:
        asked.append(rid)
        return at_hand[rid]  # type: ignore[index]

    submit(s, r, text("a", 30, max_new=20))
    run_step(s, r, ready=ready)
    submit(s, r, image("c", "cat", max_new=3))
    submit(s, r, text("d", 12, max_new=3))
    out = run_step(s, r, decode_steps=8, ready=ready)
    assert out is not None and isinstance(out.plan, PrefillPlan) and out.plan.decode is not None
    assert out.plan.seq_ids[: out.plan.num_seqs] == ("d",) and asked == ["c"]
    out = run_step(s, r, decode_steps=8, ready=ready)  # c alone left to prefill, still not at hand
    assert out is not None and isinstance(out.plan, DecodePlan) and out.plan.steps == 1
    assert out.plan.seq_ids[: out.plan.num_seqs] == ("a", "d") and s.stats.deferred_prefills == 1
    at_hand["c"] = True
    out = run_step(s, r, decode_steps=8, ready=ready)
    assert out is not None and isinstance(out.plan, PrefillPlan) and out.plan.seq_ids[0] == "c"
    assert out.plan.kv_lens[0] == PRE + 10 and set(asked) == {"c"}
    got = sampled(out.plan, out.tokens)
    assert got["c"] == [r.token_for("c", PRE + 9)]
    run_until_idle(s, r)

    s2, r2, _ = make()  # nothing decodes: the held-back prefill runs (its launch waits for the image)
    submit(s2, r2, image("x", "dog"))
    out = run_step(s2, r2, decode_steps=8, ready=lambda rid: False)
    assert out is not None and isinstance(out.plan, PrefillPlan) and out.plan.seq_ids[0] == "x"
    assert s2.stats.deferred_prefills == 0
    run_until_idle(s2, r2)


def test_default_budget_prefills_four_image_queries_per_step(make: Make) -> None:
    """The engine's default prefill buckets end at 3072: under load (the light-load budget is
    tested below) four waiting image queries (730-token prefix + an 11-token prompt each) share one
    prefill step, the fifth takes the next; with the old top bucket of 2048 only two fit
    (BENCHMARKS.md, thirty-ninth session: four images per step and per vision call gave 64
    concurrent image queries 3-5% more tokens/s)."""
    from kestrel_jax.serving.engine import EngineConfig

    buckets = EngineConfig().prefill_token_buckets
    assert buckets[-1] == 3072
    for top, per_step in ((buckets, 4), (tuple(b for b in buckets if b <= 2048), 2)):
        s, r, _ = make(num_pages=512, decode_buckets=(1, 64), max_running=64, prefill_token_buckets=top,
                       max_prefill_seqs=8, image_prefix_len=PRE)
        for i in range(5):
            submit(s, r, image(f"q{i}", f"img{i}", n=11, max_new=2))
        out = run_step(s, r)
        assert out is not None
        plan = out.plan
        assert isinstance(plan, PrefillPlan)
        assert plan.num_seqs == per_step and plan.num_tokens == per_step * (PRE + 11)
        assert len(plan.positions) == min(b for b in top if b >= per_step * (PRE + 11))
        run_until_idle(s, r)


def test_light_load_takes_the_light_budget(make: Make) -> None:
    """With light_token_budget 2048 below 3072: while fewer than `light_below_decoding` sequences
    decode, a prefill step takes two image queries (741 tokens each); once that many decode, four."""
    s, r, _ = make(num_pages=1024, decode_buckets=(1, 64), max_running=64, max_prefill_seqs=8,
                   prefill_token_buckets=(64, 256, 768, 1536, 2048, 3072), light_token_budget=2048,
                   light_below_decoding=4, mixed_decode_buckets=(64,))
    assert s.step_token_budget() == 2048
    for i in range(5):
        submit(s, r, image(f"a{i}", f"a{i}", n=11, max_new=40))
    out = run_step(s, r)
    assert out is not None and isinstance(out.plan, PrefillPlan) and out.plan.num_seqs == 2
    out = run_step(s, r)  # two decode: still light
    assert out is not None and isinstance(out.plan, PrefillPlan) and out.plan.num_seqs == 2
    assert s.step_token_budget() == 3072  # four decode now
    for i in range(4):
        submit(s, r, image(f"b{i}", f"b{i}", n=11, max_new=40))
    out = run_step(s, r)  # a4 then b0-b2: four image prompts, 2,964 tokens, in the 3072 bucket
    assert out is not None and isinstance(out.plan, PrefillPlan)
    assert out.plan.num_seqs == 4 and out.plan.num_tokens == 4 * (PRE + 11) and len(out.plan.positions) == 3072
    run_until_idle(s, r)


def test_light_budget_is_validated() -> None:
    with pytest.raises(ValueError, match="light_token_budget=512"):
        SchedulerConfig(num_pages=10, prefill_token_buckets=(1024, 2048), light_token_budget=512)
    with pytest.raises(ValueError, match="light_token_budget=4096"):
        SchedulerConfig(num_pages=10, prefill_token_buckets=(1024, 2048), light_token_budget=4096)
    with pytest.raises(ValueError, match="light_below_decoding"):
        SchedulerConfig(num_pages=10, prefill_token_buckets=(1024, 2048), light_below_decoding=-1)
