"""The worker group's routing, cancellation and stats with stand-in workers (no device)."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from kestrel_jax.serving.engine import EngineConfig, _devices
from kestrel_jax.serving.group import WorkerGroup


@dataclasses.dataclass
class Counts:
    admitted: int = 0
    hits: int = 0


class FakeWorker:
    def __init__(self, n: int):
        self.n = n
        self.subs: list[Any] = []
        self.cancelled: list[int] = []
        self.config = SimpleNamespace(max_queued=4)
        self.scheduler = SimpleNamespace(config=SimpleNamespace(running_limit=8))
        self.model = self.tokenizer = self.runner = None
        self.max_seq_len = 1024
        self.alive = True
        self.extra = 0  # pretend load

    def held(self) -> int:
        return len(self.subs) + self.extra

    def submit(self, sub: Any) -> None:
        self.subs.append(sub)

    def cancel(self, rid: int) -> None:
        self.cancelled.append(rid)

    def stats(self) -> dict[str, Any]:
        return {"live": len(self.subs), "kv_dtype": "float8_e4m3fn", "scheduler": Counts(admitted=len(self.subs)),
                "steps": {"prefill": self.n}, "prefix_cache": None}


def _sub(loop: asyncio.AbstractEventLoop, rid: int, digest: bytes | None) -> Any:
    return SimpleNamespace(job=SimpleNamespace(request_id=rid), digest=digest, future=loop.create_future())


def test_routing_by_image_then_load_and_cancel_reaches_the_holder() -> None:
    loop = asyncio.new_event_loop()
    try:
        a, b = FakeWorker(0), FakeWorker(1)
        g = WorkerGroup([a, b], spill=2)
        home = int.from_bytes(b"\x01" * 8, "little") % 2
        subs = [_sub(loop, i, b"\x01" * 32) for i in range(3)]
        for s in subs:
            g.submit(s)
        # the image's home device takes it while it holds at most `spill` more than the other (0, 1, 2)
        assert len(g.workers[home].subs) == 3 and not g.workers[1 - home].subs
        other = g.workers[1 - home]
        text = _sub(loop, 10, None)
        g.submit(text)
        assert text in other.subs  # text-only: the least loaded device
        g.cancel(10)
        g.cancel(999)  # unknown (or finished): ignored
        assert other.cancelled == [10] and not g.workers[home].cancelled
        text.future.set_result(None)
        loop.run_until_complete(asyncio.sleep(0))  # done callbacks run on the loop
        g.cancel(10)  # finished: no longer routed
        assert other.cancelled == [10]
        g.cancel(1)  # still running: reaches its device
        assert g.workers[home].cancelled == [1]
        assert g.held() == 4 and g.size == 2 and g.alive  # (stand-ins keep what they were given)
        st = g.stats()
        assert st["live"] == 4 and st["scheduler"] == {"admitted": 4, "hits": 0}
        assert st["kv_dtype"] == "float8_e4m3fn" and st["steps"] == {"prefill": 1} and len(st["devices"]) == 2
    finally:
        loop.close()


def test_spill_sends_an_image_away_from_a_busy_home() -> None:
    a, b = FakeWorker(0), FakeWorker(1)
    g = WorkerGroup([a, b], spill=2)
    digest = bytes(32)  # home 0
    assert g.pick(digest) == 0
    a.extra = 2
    assert g.pick(digest) == 0  # 2 more than the other: still home
    a.extra = 3
    assert g.pick(digest) == 1 and g.pick(None) == 1
    with pytest.raises(ValueError, match="at least two"):
        WorkerGroup([a])


def test_num_devices_is_checked_against_the_local_devices() -> None:
    assert _devices(EngineConfig()) == [0]
    with pytest.raises(ValueError, match="num_devices=5"):
        _devices(EngineConfig(num_devices=5))
    with pytest.raises(ValueError, match="num_devices=-1"):
        _devices(EngineConfig(num_devices=-1))
