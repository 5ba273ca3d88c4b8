"""Images encoded on a worker thread ahead of their prefill (`EngineConfig.vision_thread`).

The engine thread launches every step; on the GPU machine it, not the device, bounded 64
concurrent image queries while it also launched the vision step (hundreds of kernels and
parameter arrays per image; BENCHMARKS.md, ninth and tenth sessions). Here each admitted
request's image is encoded on one worker thread instead, and its prefill step picks the
encoding up.

At most `window` images are encoded and not yet prefilled at a time: an offline job that queues
thousands of requests must not hold thousands of encodings (3 MB each for MD3) in device
memory, nor spend the device on images whose prefill is minutes away. Requests beyond the window
wait in arrival order and start as earlier images are prefilled (their last image chunk
launched) or dropped; one whose prefill comes before its turn (the scheduler orders by arrival
and priority, and images are prepared side by side, so admissions can come out of that order) is
started then, on the worker, past the window until its image is prefilled: the engine thread
waits for it as it would for its own encoding, and launches none of the vision step. Requests on
one image (same digest) share one encoding. An image leaves the window when its prefill is
launched, for all its requests. A request whose image the prefix cache holds is not encoded; if
its cache entry is gone by its prefill, `take` returns None and the caller encodes it in place.

With `encode_many`, the worker encodes up to `max_batch` queued images in one call (the runner
encodes one-crop images together: more of the GPU busy per launch, BENCHMARKS.md, thirteenth
session). It starts a call when `max_batch` images are queued, when the engine thread asks for a
queued image (its prefill is being launched), or when the oldest queued image has waited
`max_wait_s` (0: at once, with whatever is queued). Urgent admissions made together
(`admitting`, one inbox drain) are asked for when the last of them is queued, so that they go in
one call. If a call fails, each of its images is encoded on its own, so that a bad image fails
its own requests only.

All methods are called from the engine thread; only `encode` and `encode_many` run on the worker.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any


class EncodeAhead:
    def __init__(self, encode: Callable[[Any], Any], cached: Callable[[int], bool], window: int,
                 encode_many: Callable[[list[Any]], list[Any]] | None = None, max_batch: int = 1,
                 max_wait_s: float = 0.0):
        """encode(sub) -> the image's encoding (a device array; runs on the worker thread);
        cached(request_id) -> whether the prefix cache holds the request's image;
        encode_many(subs) -> their encodings, in order (2 to `max_batch` images)."""
        if window < 1:
            raise ValueError(f"the encode-ahead window must be >= 1 image, got {window}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 image, got {max_batch}")
        if not max_wait_s >= 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self._encode = encode
        self._encode_many = encode_many
        self._max_batch = max_batch if encode_many is not None else 1
        self._max_wait_s = max_wait_s if self._max_batch > 1 else 0.0
        self._cached = cached
        self.window = window
        self._cv = threading.Condition()
        # started, not yet taken by the worker: (submission, its future, when queued)
        self._queue: deque[tuple[Any, Future[Any], float]] = deque()
        self._demanded: set[int] = set()  # id() of queued futures the engine thread waits for
        self._closing = False
        self.calls: Counter[int] = Counter()  # encoding calls on the worker by image count
        self._thread = threading.Thread(target=self._run, name="kestrel-jax-vision", daemon=True)
        self._thread.start()
        # digest -> (encoding, requests that still need it)
        self._entries: dict[bytes, tuple[Future[Any], set[int]]] = {}
        self._waiting: OrderedDict[int, Any] = OrderedDict()  # request id -> submission, arrival order
        self.started = 0  # encodings launched on the worker (statistics, tests)
        self._held_demands: list[Future[Any]] | None = None  # within `admitting`

    @contextlib.contextmanager
    def admitting(self) -> Iterator[None]:
        """Admissions made together (the engine thread's inbox drain): the urgent images among
        them are asked for on leaving, once all are queued, so that they go in one call (asked
        for one by one, the worker could start on the first before the next was queued)."""
        if self._held_demands is not None:  # nested: the outer one asks
            yield
            return
        self._held_demands = []
        try:
            yield
        finally:
            held, self._held_demands = self._held_demands, None
            self._demand(*held)

    @property
    def pending(self) -> int:
        """Images encoded or being encoded and not yet prefilled (at most `window`)."""
        return len(self._entries)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def holds(self, sub: Any) -> bool:
        entry = self._entries.get(sub.digest)
        return entry is not None and sub.job.request_id in entry[1]

    def add(self, sub: Any, urgent: bool = False) -> None:
        """A new request with an image (its `digest` set). `urgent`: its prefill is expected next,
        so if its image is started (within the window) or already queued, its call starts at once
        instead of waiting for a fuller batch, as when the engine asks for it (`ready`, `take`)."""
        rid = sub.job.request_id
        entry = self._entries.get(sub.digest)
        if entry is not None:
            entry[1].add(rid)
        elif self._cached(rid):
            return
        elif len(self._entries) < self.window:
            self._start(sub)
            entry = self._entries[sub.digest]
        else:
            self._waiting[rid] = sub
        if urgent and entry is not None:
            if self._held_demands is not None:
                self._held_demands.append(entry[0])
            else:
                self._demand(entry[0])

    def take(self, sub: Any, last: bool) -> Any | None:
        """The request's encoding for a prefill chunk of its image (started now if the request
        was still waiting for a slot), or None (its image was expected in the prefix cache, or
        it was taken for its last chunk already: encode it in place). `last`: this chunk ends the
        image prefix: the image is prefilled, so the encoding leaves the window, also for other
        requests on the image (they find its KV pages in the prefix cache; one that misses it gets
        None and is encoded in place). An error raised on the worker is raised here."""
        entry = self._wanted(sub)
        if entry is None:
            return None
        fut = entry[0]
        try:
            return fut.result()
        finally:
            if last:
                entry[1].clear()
                self._release(sub.job.request_id, sub.digest)

    def ready(self, sub: Any) -> bool:
        """Whether `take` would return at once for this request: its encoding is done, or it has
        none here (`take` returns None). Otherwise its encoding is asked for now, as `take` would
        (a waiting request is started out of turn; a queued image's call starts without waiting for
        a fuller batch), and False."""
        entry = self._wanted(sub)
        return entry is None or entry[0].done()

    def _wanted(self, sub: Any) -> tuple[Future[Any], set[int]] | None:
        """The request's entry (None: not encoded here), its encoding started and demanded."""
        rid = sub.job.request_id
        if self._waiting.pop(rid, None) is not None:  # reached its prefill before its turn came:
            entry = self._entries.get(sub.digest)  # started now, out of turn (over the window
            if entry is None:                       # until its image is prefilled)
                self._start(sub)
            else:
                entry[1].add(rid)
        entry = self._entries.get(sub.digest)
        if entry is None or rid not in entry[1]:
            return None
        self._demand(entry[0])
        return entry

    def _demand(self, *futs: Future[Any]) -> None:
        """Those of these images still queued get their call started at once (the asked-for images
        first; all marked before the worker looks)."""
        futs = tuple(f for f in futs if not f.done())
        if not futs:
            return
        with self._cv:
            queued = {id(f) for _, f, _ in self._queue}
            asked = {id(f) for f in futs} & queued
            if asked:
                self._demanded |= asked
                self._cv.notify()

    def drop(self, sub: Any) -> None:
        """The request ended (finished, failed or cancelled): it holds nothing any more."""
        rid = sub.job.request_id
        self._waiting.pop(rid, None)
        entry = self._entries.get(sub.digest)
        if entry is not None and rid in entry[1]:
            self._release(rid, sub.digest)

    def encodings(self) -> list[Any]:
        """The encodings finished and not yet released (the engine waits for their device work
        before it goes: a computation still running at interpreter exit can crash it)."""
        return [fut.result() for fut, _ in self._entries.values()
                if fut.done() and not fut.cancelled() and fut.exception() is None]

    def shutdown(self) -> None:
        """Cancel the queued encodings and wait for the one running."""
        self._waiting.clear()
        with self._cv:
            self._closing = True
            for _, fut, _ in self._queue:
                fut.cancel()
            self._queue.clear()
            self._cv.notify()
        self._thread.join()

    def _start(self, sub: Any) -> None:
        fut: Future[Any] = Future()
        self._entries[sub.digest] = (fut, {sub.job.request_id})
        with self._cv:
            self._queue.append((sub, fut, time.monotonic()))
            self._cv.notify()
        self.started += 1

    def _next_batch(self) -> list[tuple[Any, Future[Any]]] | None:
        """On the worker: wait until a call is due, then take its images (the demanded ones
        first, then in queue order). None: shutting down."""
        with self._cv:
            while True:
                if self._closing:
                    return None
                while self._queue and self._queue[0][1].cancelled():  # released while queued
                    self._queue.popleft()
                if self._queue:
                    wait = self._max_wait_s - (time.monotonic() - self._queue[0][2])
                    if len(self._queue) >= self._max_batch or self._demanded or wait <= 0:
                        break
                    self._cv.wait(wait)
                else:
                    self._cv.wait()
            order = sorted(self._queue, key=lambda item: id(item[1]) not in self._demanded)  # stable
            batch: list[tuple[Any, Future[Any]]] = []
            for item in order:
                if len(batch) == self._max_batch:
                    break
                self._queue.remove(item)
                self._demanded.discard(id(item[1]))
                if item[1].set_running_or_notify_cancel():  # False: released (cancelled) while queued
                    batch.append((item[0], item[1]))
            self._demanded &= {id(f) for _, f, _ in self._queue}
            return batch

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            if batch:
                self._work(batch)

    def _work(self, batch: list[tuple[Any, Future[Any]]]) -> None:
        """On the worker: encode these images in one call (one by one if that fails)."""
        self.calls[len(batch)] += 1
        if len(batch) > 1:
            assert self._encode_many is not None
            try:
                outs = list(self._encode_many([sub for sub, _ in batch]))
                if len(outs) != len(batch):
                    raise RuntimeError(f"{len(outs)} encodings for {len(batch)} images")
            except Exception:  # noqa: BLE001 - one by one below: a bad image fails only itself
                pass
            else:
                for (_, fut), out in zip(batch, outs, strict=True):
                    fut.set_result(out)
                return
        for sub, fut in batch:
            try:
                fut.set_result(self._encode(sub))
            except BaseException as e:  # noqa: BLE001 - delivered to the request by take()
                fut.set_exception(e)

    def _release(self, rid: int, digest: bytes) -> None:
        fut, rids = self._entries[digest]
        rids.discard(rid)  # (empty when the image was prefilled)
        if rids:
            return
        fut.cancel()
        del self._entries[digest]
        while self._waiting and len(self._entries) < self.window:
            _, sub = self._waiting.popitem(last=False)
            self.add(sub)
