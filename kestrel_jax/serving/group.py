"""Several engine workers, one per local device, behind the single worker's interface.

`InferenceEngine.create` starts one `EngineWorker` per device when `EngineConfig.num_devices` asks
for more than one (data parallel: each device holds the whole model, its own KV pool, prefix cache
and scheduler; nothing crosses devices). `WorkerGroup` routes each request to one of them:

* a request with an image goes to the device its image digest maps to (a second query on the same
  image then finds that device's prefix cache), unless that device holds `spill` more requests
  than the least loaded one, which then takes it;
* a text-only request goes to the least loaded device (fewest requests held; ties: lowest index).

Cancellation reaches the device that holds the request. Stats sum the devices' counters (the
`devices` entry keeps each device's own).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class WorkerGroup:
    def __init__(self, workers: Sequence[Any], spill: int | None = None):
        if len(workers) < 2:
            raise ValueError("a worker group needs at least two workers")
        self.workers = list(workers)
        first = self.workers[0]
        self.config = first.config
        self.model = first.model
        self.tokenizer = first.tokenizer
        self.runner = first.runner  # host-side image preparation only (crop plans are device-free)
        self.scheduler = first.scheduler  # its config: every device's is the same
        self.max_seq_len = first.max_seq_len
        # How far above the least loaded device an image's own device may be before the request
        # goes elsewhere: a quarter of one device's batch.
        self.spill = spill if spill is not None else max(1, first.scheduler.config.running_limit // 4)
        self._owner: dict[int, Any] = {}
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        return len(self.workers)

    @property
    def alive(self) -> bool:
        return all(w.alive for w in self.workers)

    def held(self) -> int:
        return sum(w.held() for w in self.workers)

    def pick(self, digest: bytes | None) -> int:
        """Index of the worker a new request goes to (see the module docstring)."""
        loads = [w.held() for w in self.workers]
        least = min(range(len(loads)), key=lambda i: (loads[i], i))
        if digest is None:
            return least
        home = int.from_bytes(digest[:8], "little") % len(self.workers)
        return home if loads[home] - loads[least] <= self.spill else least

    def submit(self, sub: Any) -> None:
        worker = self.workers[self.pick(sub.digest)]
        rid = sub.job.request_id
        with self._lock:
            self._owner[rid] = worker
        sub.future.add_done_callback(lambda _f: self._forget(rid))
        try:
            worker.submit(sub)
        except BaseException:
            self._forget(rid)
            raise

    def _forget(self, rid: int) -> None:
        with self._lock:
            self._owner.pop(rid, None)

    def cancel(self, request_id: int) -> None:
        with self._lock:
            worker = self._owner.get(request_id)
        if worker is not None:
            worker.cancel(request_id)

    def stop(self) -> None:
        with ThreadPoolExecutor(len(self.workers)) as pool:
            list(pool.map(lambda w: w.stop(), self.workers))

    def stats(self) -> dict[str, Any]:
        per = [w.stats() for w in self.workers]
        out = _summed(per)
        out["devices"] = per
        return out


def _as_mapping(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
    return x


def _summed(items: Sequence[Any]) -> Any:
    """Numbers summed, mappings (and dataclasses, as mappings) merged key by key, anything else
    (a dtype name, None) taken from the first item."""
    first = _as_mapping(items[0])
    if isinstance(first, Mapping):
        maps = [_as_mapping(x) or {} for x in items]
        keys = list(dict.fromkeys(k for m in maps for k in m))
        return {k: _summed([m[k] for m in maps if k in m]) for k in keys}
    if all(isinstance(x, int | float) and not isinstance(x, bool) for x in items):
        return sum(items)
    return first
