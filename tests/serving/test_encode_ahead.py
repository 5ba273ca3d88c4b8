"""EncodeAhead (the vision thread's bookkeeping) without a model: the window bounds the images
encoded and not yet prefilled, later arrivals start in arrival order as earlier ones are
prefilled or dropped, one image is encoded once for all its requests, cached images never, and
a request that reaches its prefill before its turn is started then, on the worker."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import pytest

from kestrel_jax.serving.encode_ahead import EncodeAhead


@dataclass
class Job:
    request_id: int


@dataclass
class Sub:
    rid: int
    digest: bytes
    job: Job = field(init=False)

    def __post_init__(self) -> None:
        self.job = Job(self.rid)


class Recorder:
    def __init__(self, cached: set[int] | None = None, fail: set[bytes] | None = None):
        self.calls: list[tuple[int, str]] = []
        self.cached = cached if cached is not None else set()
        self.fail = fail or set()
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()  # an encoding has started

    def encode(self, sub: Sub) -> str:
        self.entered.set()
        self.gate.wait(10)
        self.calls.append((sub.rid, threading.current_thread().name))
        if sub.digest in self.fail:
            raise RuntimeError(f"bad image {sub.digest!r}")
        return f"enc-{sub.digest.decode()}"

    def ahead(self, window: int) -> EncodeAhead:
        return EncodeAhead(self.encode, lambda rid: rid in self.cached, window)


def test_window_bounds_encodings_and_later_arrivals_start_in_order() -> None:
    rec = Recorder()
    ea = rec.ahead(2)
    subs = [Sub(i, f"img{i}".encode()) for i in range(5)]
    for s in subs:
        ea.add(s)
    assert (ea.pending, ea.waiting, ea.started) == (2, 3, 2)
    assert ea.take(subs[0], last=True) == "enc-img0"  # prefilled: request 2 starts
    assert (ea.pending, ea.waiting, ea.started) == (2, 2, 3) and ea.holds(subs[2])
    ea.drop(subs[1])  # cancelled before its prefill: request 3 starts
    assert ea.holds(subs[3]) and not ea.holds(subs[4]) and ea.waiting == 1
    # request 4 reaches its prefill before its turn: started now on the worker, past the window
    assert ea.take(subs[4], last=False) == "enc-img4" and ea.waiting == 0
    assert (ea.pending, ea.started) == (3, 5) and ea.holds(subs[4])
    assert ea.take(subs[4], last=True) == "enc-img4" and ea.pending == 2
    assert ea.take(subs[2], last=True) == "enc-img2" and ea.take(subs[3], last=True) == "enc-img3"
    assert (ea.pending, ea.waiting, ea.started) == (0, 0, 5)
    ea.shutdown()
    got = sorted(r for r, _ in rec.calls)  # request 1's encoding may have been cancelled before it ran
    assert got in ([0, 2, 3, 4], [0, 1, 2, 3, 4]), got
    assert all(t.startswith("kestrel-jax-vision") for _, t in rec.calls)


def test_chunked_image_keeps_its_encoding_until_the_last_chunk() -> None:
    rec = Recorder()
    ea = rec.ahead(1)
    a, b = Sub(1, b"a"), Sub(2, b"b")
    ea.add(a)
    ea.add(b)
    assert ea.take(a, last=False) == "enc-a" and ea.holds(a) and ea.waiting == 1
    assert ea.take(a, last=False) == "enc-a"
    assert ea.take(a, last=True) == "enc-a" and not ea.holds(a) and ea.holds(b)
    assert ea.take(a, last=True) is None  # nothing held any more: the caller would encode
    assert ea.take(b, last=True) == "enc-b"
    ea.shutdown()
    assert [r for r, _ in rec.calls] == [1, 2]


def test_one_image_is_encoded_once_and_leaves_the_window_when_prefilled() -> None:
    rec = Recorder()
    ea = rec.ahead(1)
    a1, a2, a3, c = Sub(1, b"a"), Sub(2, b"a"), Sub(3, b"a"), Sub(4, b"c")
    for s in (a1, a2, c):
        ea.add(s)
    assert ea.pending == 1 and ea.waiting == 1  # a1 and a2 share one slot; c waits
    ea.drop(a1)  # cancelled: a2 still needs the encoding
    assert ea.holds(a2) and ea.waiting == 1
    # a2's prefill: the image is prefilled, its slot frees and c starts; another request on it
    # (a3) finds its pages in the prefix cache, or else (here: it waits for c's slot and reaches
    # its prefill first) is encoded again, out of turn
    assert ea.take(a2, last=True) == "enc-a" and ea.holds(c) and ea.waiting == 0
    ea.add(a3)
    assert ea.waiting == 1 and ea.take(a3, last=True) == "enc-a" and ea.waiting == 0
    ea.drop(a2)  # no-op: it holds nothing any more
    assert ea.take(c, last=True) == "enc-c" and ea.pending == 0
    ea.shutdown()
    assert sorted(r for r, _ in rec.calls) == [1, 3, 4]
    assert all(t.startswith("kestrel-jax-vision") for _, t in rec.calls)


def test_cached_images_are_not_encoded_also_when_their_turn_comes() -> None:
    rec = Recorder(cached={2, 3})
    ea = rec.ahead(1)
    subs = [Sub(1, b"x"), Sub(2, b"y"), Sub(3, b"z"), Sub(4, b"w")]
    for s in subs:
        ea.add(s)
    assert ea.pending == 1 and ea.waiting == 1  # 2 and 3 cached: not queued at all
    rec.cached.add(4)  # cached by the time its turn comes
    assert ea.take(subs[0], last=True) == "enc-x"
    assert ea.pending == 0 and ea.waiting == 0
    ea.shutdown()
    assert [r for r, _ in rec.calls] == [1]


def test_worker_errors_reach_the_request_and_free_its_slot() -> None:
    rec = Recorder(fail={b"bad"})
    ea = rec.ahead(1)
    bad, ok = Sub(1, b"bad"), Sub(2, b"ok")
    ea.add(bad)
    ea.add(ok)
    with pytest.raises(RuntimeError, match="bad image"):
        ea.take(bad, last=True)
    assert ea.holds(ok) and ea.take(ok, last=True) == "enc-ok"
    ea.shutdown()


def test_shutdown_cancels_queued_work_and_a_bad_window_is_refused() -> None:
    rec = Recorder()
    rec.gate.clear()  # the worker blocks in the first encoding; the other two queue behind it
    ea = rec.ahead(3)
    for i in range(3):
        ea.add(Sub(i, bytes([i])))
    assert rec.entered.wait(10)
    threading.Timer(0.3, rec.gate.set).start()  # released while shutdown waits for it
    ea.shutdown()
    assert [r for r, _ in rec.calls] == [0]  # the queued encodings were cancelled, not run
    with pytest.raises(ValueError, match="window"):
        rec.ahead(0)


@pytest.mark.parametrize("field", ["vision_ahead", "decode_steps", "compile_threads", "multi_step_max_batch",
                                   "warmup_runs"])
def test_engine_refuses_a_count_below_one_before_loading_anything(field: str) -> None:
    from kestrel_jax.serving.engine import EngineConfig
    from kestrel_jax.serving.loop import EngineWorker

    with pytest.raises(ValueError, match=field):
        EngineWorker(EngineConfig(**{field: 0}), model=None, tokenizer=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("cores,threads", [(1, 1), (2, 1), (3, 1), (4, 2), (16, 8), (64, 8)])
def test_default_compile_threads_are_half_the_cores_up_to_eight(cores: int, threads: int,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from kestrel_jax.serving import engine

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert engine.default_compile_threads() == threads
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # not on Linux: the machine's count
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    assert engine.default_compile_threads() == threads
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert engine.default_compile_threads() == 1


class BatchRecorder(Recorder):
    def __init__(self, fail_many: bool = False, **kw: object):
        super().__init__(**kw)  # type: ignore[arg-type]
        self.many: list[list[int]] = []
        self.fail_many = fail_many

    def encode_many(self, subs: list[Sub]) -> list[str]:
        self.gate.wait(10)
        self.many.append([s.rid for s in subs])
        if self.fail_many or any(s.digest in self.fail for s in subs):
            raise RuntimeError("the batch failed")
        return [f"many-{s.digest.decode()}" for s in subs]

    def ahead(self, window: int, max_batch: int = 3, max_wait_s: float = 0.0) -> EncodeAhead:
        return EncodeAhead(self.encode, lambda rid: rid in self.cached, window, self.encode_many, max_batch,
                           max_wait_s)


def test_images_queued_behind_a_running_encoding_are_encoded_together() -> None:
    rec = BatchRecorder()
    rec.gate.clear()  # the first encoding blocks; the next five queue behind it
    ea = rec.ahead(8, max_batch=3)
    subs = [Sub(i, f"i{i}".encode()) for i in range(6)]
    ea.add(subs[0])
    assert rec.entered.wait(10)
    for s in subs[1:]:
        ea.add(s)
    ea.drop(subs[2])  # released while queued: skipped, never encoded
    rec.gate.set()
    assert ea.take(subs[0], last=True) == "enc-i0"
    # at most 3 per call: 1, 3 and 4 together, then 5 on its own (the one-image encoder)
    assert [ea.take(s, last=True) for s in subs[3:]] == ["many-i3", "many-i4", "enc-i5"]
    assert ea.take(subs[1], last=True) == "many-i1"
    ea.shutdown()
    assert [r for r, _ in rec.calls] == [0, 5] and rec.many == [[1, 3, 4]]
    assert ea.calls == {1: 2, 3: 1}


def test_a_failed_batch_is_encoded_one_by_one_and_only_the_bad_image_fails() -> None:
    rec = BatchRecorder(fail={b"bad"})
    rec.gate.clear()
    ea = rec.ahead(8, max_batch=4)
    first, bad, ok1, ok2 = Sub(0, b"first"), Sub(1, b"bad"), Sub(2, b"ok1"), Sub(3, b"ok2")
    ea.add(first)
    assert rec.entered.wait(10)
    for s in (bad, ok1, ok2):
        ea.add(s)
    rec.gate.set()
    assert ea.take(first, last=True) == "enc-first"
    with pytest.raises(RuntimeError, match="bad image"):
        ea.take(bad, last=True)
    assert ea.take(ok1, last=True) == "enc-ok1" and ea.take(ok2, last=True) == "enc-ok2"
    ea.shutdown()
    assert rec.many == [[1, 2, 3]] and sorted(r for r, _ in rec.calls) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="max_batch"):
        rec.ahead(2, max_batch=0)


def test_with_a_wait_images_gather_until_a_full_call_the_engine_asks_or_the_wait_ends() -> None:
    import time

    rec = BatchRecorder()
    ea = rec.ahead(8, max_batch=3, max_wait_s=30.0)
    subs = [Sub(i, f"w{i}".encode()) for i in range(7)]
    ea.add(subs[0])
    ea.add(subs[1])
    time.sleep(0.1)
    assert rec.many == [] and rec.calls == []  # two of three queued: waiting for a third
    ea.add(subs[2])
    assert ea.take(subs[1], last=True) == "many-w1"
    assert len(rec.many) == 1 and sorted(rec.many[0]) == [0, 1, 2]  # (1 first if asked for before the call)
    # the engine asks for a queued image: its call starts at once, the asked-for image first
    ea.add(subs[3])
    ea.add(subs[4])
    t0 = time.monotonic()
    assert ea.take(subs[4], last=True) == "many-w4" and time.monotonic() - t0 < 10
    assert rec.many[-1] == [4, 3]
    ea.shutdown()
    # a short wait: a lone image is encoded once it ends
    rec = BatchRecorder()
    ea = rec.ahead(8, max_batch=3, max_wait_s=0.05)
    ea.add(subs[5])
    t0 = time.monotonic()
    while not rec.calls and time.monotonic() - t0 < 10:
        time.sleep(0.01)
    assert [r for r, _ in rec.calls] == [5] and time.monotonic() - t0 >= 0.04
    ea.add(subs[6])
    ea.shutdown()  # the queued image is cancelled, the worker ends
    assert [r for r, _ in rec.calls] == [5] and rec.many == []
    with pytest.raises(ValueError, match="max_wait_s"):
        rec.ahead(2, max_wait_s=-1.0)


def test_ready_says_whether_take_would_wait_and_asks_for_the_encoding() -> None:
    """`ready` never blocks: False while the request's encoding is queued or running (a queued
    image's call then starts at once instead of waiting for a fuller batch; a request still waiting
    for the window is started out of turn, as `take` would), True once it is done or when the
    request has no encoding here (cached, or unknown: `take` returns None)."""
    import time

    rec = BatchRecorder()
    rec.cached = {9}
    ea = rec.ahead(1, max_batch=3, max_wait_s=30.0)
    a, b, c = Sub(0, b"a"), Sub(1, b"b"), Sub(9, b"c")
    ea.add(a)
    ea.add(b)  # the window (1) is full: b waits
    ea.add(c)  # cached: nothing to encode
    assert ea.waiting == 1 and ea.ready(c)
    t0 = time.monotonic()
    assert not ea.ready(a)  # queued alone behind a 30 s batch wait: asked for, so its call starts now
    while not ea.ready(a) and time.monotonic() - t0 < 10:
        time.sleep(0.01)
    assert ea.ready(a) and time.monotonic() - t0 < 10 and [r for r, _ in rec.calls] == [0]
    rec.gate.clear()
    rec.entered.clear()
    assert not ea.ready(b) and ea.waiting == 0 and ea.holds(b)  # started out of turn
    assert rec.entered.wait(10) and not ea.ready(b)  # running, not done
    rec.gate.set()
    assert ea.take(b, last=True) == "enc-b" and ea.ready(b)  # taken: nothing held for it any more
    assert ea.take(a, last=True) == "enc-a"
    ea.shutdown()


def test_an_urgent_image_starts_its_call_without_waiting_for_a_fuller_batch() -> None:
    """`add(urgent=True)` (EngineConfig.admit_before_wait: the request's prefill comes next): its
    call starts at once despite a long batch wait, with whatever else is queued; a second request
    on an image already queued makes it urgent too; over the window it waits its turn as before."""
    import time

    def wait_for(cond: Any) -> bool:
        t0 = time.monotonic()
        while not cond() and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        return bool(cond())

    rec = BatchRecorder()
    ea = rec.ahead(3, max_batch=4, max_wait_s=30.0)
    a, b, c, d, e = (Sub(i, f"u{i}".encode()) for i in range(5))
    ea.add(a)
    ea.add(b, urgent=True)  # queued with a: both go in one call now
    assert wait_for(lambda: len(rec.many) == 1)
    assert sorted(rec.many[0]) == [0, 1]
    ea.add(c)
    time.sleep(0.1)
    assert len(rec.many) == 1 and rec.calls == []  # not urgent: waits for a fuller batch
    ea.add(Sub(5, b"u2"), urgent=True)  # another request on c's image, urgent
    assert wait_for(lambda: [r for r, _ in rec.calls] == [2])
    ea.add(d)  # the window (3 images) is full: d waits, urgent or not
    ea.add(e, urgent=True)
    assert ea.waiting == 2
    assert ea.take(a, last=True) == "many-u0"  # a leaves the window: d starts (not urgent)
    assert ea.waiting == 1 and ea.holds(d)
    ea.shutdown()


def test_urgent_images_admitted_together_go_in_one_call() -> None:
    """Within `admitting` (one inbox drain), urgent images are asked for on leaving, once all are
    queued: the worker does not start on the first while the others are still being admitted."""
    import time

    rec = BatchRecorder()
    ea = rec.ahead(8, max_batch=4, max_wait_s=30.0)
    subs = [Sub(i, f"t{i}".encode()) for i in range(3)]
    with ea.admitting():
        ea.add(subs[0], urgent=True)
        time.sleep(0.2)  # time enough for the worker to start a call if it were asked for already
        assert rec.many == [] and rec.calls == []
        with ea.admitting():  # nested: the outer one asks
            ea.add(subs[1], urgent=True)
        time.sleep(0.1)
        assert rec.many == [] and rec.calls == []
        ea.add(subs[2], urgent=True)
    t0 = time.monotonic()
    while not rec.many and time.monotonic() - t0 < 10:
        time.sleep(0.01)
    assert [sorted(m) for m in rec.many] == [[0, 1, 2]] and rec.calls == []
    assert [ea.take(s, last=True) for s in subs] == ["many-t0", "many-t1", "many-t2"]
    ea.shutdown()
