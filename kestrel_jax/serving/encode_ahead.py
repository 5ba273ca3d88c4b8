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
launched) or dropped. Requests on one image (same digest) share one encoding. An image leaves the window
when its prefill is launched, for all its requests. A request whose image the prefix cache holds
is not encoded; if its cache entry is gone by its prefill, or its
encoding was never started, `take` returns None and the caller encodes it in place.

All methods are called from the engine thread; only `encode` runs on the worker.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class EncodeAhead:
    def __init__(self, encode: Callable[[Any], Any], cached: Callable[[int], bool], window: int):
        """encode(sub) -> the image's encoding (a device array; runs on the worker thread);
        cached(request_id) -> whether the prefix cache holds the request's image."""
        if window < 1:
            raise ValueError(f"the encode-ahead window must be >= 1 image, got {window}")
        self._encode = encode
        self._cached = cached
        self.window = window
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kestrel-jax-vision")
        # digest -> (encoding, requests that still need it)
        self._entries: dict[bytes, tuple[Future[Any], set[int]]] = {}
        self._waiting: OrderedDict[int, Any] = OrderedDict()  # request id -> submission, arrival order
        self.started = 0  # encodings launched on the worker (statistics, tests)

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

    def add(self, sub: Any) -> None:
        """A new request with an image (its `digest` set)."""
        rid = sub.job.request_id
        entry = self._entries.get(sub.digest)
        if entry is not None:
            entry[1].add(rid)
        elif self._cached(rid):
            return
        elif len(self._entries) < self.window:
            self._start(sub)
        else:
            self._waiting[rid] = sub

    def take(self, sub: Any, last: bool) -> Any | None:
        """The request's encoding for a prefill chunk of its image, or None (not encoded ahead:
        encode it in place). `last`: this chunk ends the image prefix: the image is prefilled, so
        the encoding leaves the window, also for other requests on the image (they find its KV
        pages in the prefix cache; one that misses it gets None and is encoded in place). An
        error raised on the worker is raised here."""
        rid = sub.job.request_id
        if self._waiting.pop(rid, None) is not None:
            return None  # reached its prefill before its turn came
        entry = self._entries.get(sub.digest)
        if entry is None or rid not in entry[1]:
            return None
        try:
            return entry[0].result()
        finally:
            if last:
                entry[1].clear()
                self._release(rid, sub.digest)

    def drop(self, sub: Any) -> None:
        """The request ended (finished, failed or cancelled): it holds nothing any more."""
        rid = sub.job.request_id
        self._waiting.pop(rid, None)
        entry = self._entries.get(sub.digest)
        if entry is not None and rid in entry[1]:
            self._release(rid, sub.digest)

    def shutdown(self) -> None:
        self._waiting.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _start(self, sub: Any) -> None:
        self._entries[sub.digest] = (self._pool.submit(self._encode, sub), {sub.job.request_id})
        self.started += 1

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
