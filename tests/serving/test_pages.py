"""Page allocator, page-table mirror, slot mapping and buckets (host only, no JAX)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from kestrel_jax.serving.buckets import BucketError, pick_bucket, validate_buckets
from kestrel_jax.serving.pages import (
    DoubleFreeError,
    OutOfPagesError,
    PageAccountingError,
    PageAllocator,
    PageTables,
    pages_for,
    slots_for,
)


def _expected(counter: Counter[int], num_pages: int) -> np.ndarray:
    out = np.zeros(num_pages, np.int32)
    for p, c in counter.items():
        out[p] = c
    return out


def test_allocate_free_roundtrip() -> None:
    a = PageAllocator(8, 16)
    pages = a.allocate(3)
    assert len(set(pages)) == 3 and a.num_free == 5 and a.num_used == 3
    assert all(a.refcount(p) == 1 for p in pages)
    assert a.decref(pages) == 3
    assert a.num_free == 8
    a.check_leaks(np.zeros(8, np.int32))


def test_shared_pages_free_on_last_reference() -> None:
    a = PageAllocator(4, 16)
    (p,) = a.allocate(1)
    a.incref([p, p])
    assert a.refcount(p) == 3
    assert a.decref([p]) == 0 and a.decref([p]) == 0
    assert a.num_free == 3
    assert a.decref([p]) == 1
    assert a.num_free == 4


def test_double_free_and_bad_ids_raise() -> None:
    a = PageAllocator(4, 16)
    pages = a.allocate(2)
    a.decref(pages)
    with pytest.raises(DoubleFreeError):
        a.decref(pages[:1])
    (q,) = a.allocate(1)
    with pytest.raises(DoubleFreeError):  # two releases of a page referenced once, in one call
        a.decref([q, q])
    assert a.refcount(q) == 1, "a failed decref must change nothing"
    free_page = next(p for p in range(4) if a.refcount(p) == 0)
    with pytest.raises(PageAccountingError):
        a.incref([free_page])
    with pytest.raises(PageAccountingError):
        a.decref([4])
    with pytest.raises(PageAccountingError):
        a.incref([-1])


def test_out_of_pages_leaves_pool_intact() -> None:
    a = PageAllocator(5, 16)
    held = a.allocate(4)
    with pytest.raises(OutOfPagesError):
        a.allocate(2)
    assert a.num_free == 1
    a.check_leaks(_expected(Counter(held), 5))
    assert a.allocate(0) == []


def test_invalid_construction() -> None:
    with pytest.raises(ValueError):
        PageAllocator(0, 16)
    with pytest.raises(ValueError):
        PageAllocator(4, 24)


def test_check_leaks_detects_disagreement() -> None:
    a = PageAllocator(6, 16)
    pages = a.allocate(2)
    exp = _expected(Counter(pages), 6)
    a.check_leaks(exp)
    exp[pages[0]] = 0  # a holder "forgot" it holds this page: a leak
    with pytest.raises(PageAccountingError, match="disagree"):
        a.check_leaks(exp)


class _FakeReclaimer:
    """Holds pages it frees on request, oldest first."""

    def __init__(self, alloc: PageAllocator, pages: list[int]) -> None:
        self.alloc, self.pages = alloc, list(pages)
        self.calls: list[int] = []

    def reclaimable(self) -> int:
        return len(self.pages)

    def reclaim(self, num_pages: int) -> int:
        self.calls.append(num_pages)
        take, self.pages = self.pages[:num_pages], self.pages[num_pages:]
        return self.alloc.decref(take)


def test_reclaimer_is_asked_only_under_pressure() -> None:
    a = PageAllocator(6, 16)
    r = _FakeReclaimer(a, a.allocate(4))
    a.set_reclaimer(r)
    assert a.available() == 6 and a.can_allocate(6) and not a.can_allocate(7)
    a.allocate(2)
    assert r.calls == []
    got = a.allocate(3)
    assert r.calls == [3] and len(got) == 3 and len(r.pages) == 1
    with pytest.raises(OutOfPagesError):
        a.allocate(3)


def test_random_ops_match_a_reference_model() -> None:
    rng = np.random.default_rng(0)
    n = 64
    a = PageAllocator(n, 8)
    held: Counter[int] = Counter()
    for _ in range(2000):
        op = rng.integers(3)
        if op == 0:
            k = int(rng.integers(0, 6))
            if k <= a.num_free:
                for p in a.allocate(k):
                    assert held[p] == 0
                    held[p] = 1
            else:
                with pytest.raises(OutOfPagesError):
                    a.allocate(k)
        elif op == 1 and held:
            p = int(rng.choice(list(held)))
            a.incref([p])
            held[p] += 1
        elif held:
            p = int(rng.choice(list(held)))
            a.decref([p])
            held[p] -= 1
            if not held[p]:
                del held[p]
        a.check_leaks(_expected(held, n))
        assert a.num_free == n - len(held)


def test_page_tables_rows_and_slots() -> None:
    t = PageTables(max_seqs=3, max_pages_per_seq=4)
    r0 = t.assign([5, 2])
    r1 = t.assign([7, 1, 3, 0])
    assert r0 != r1 and t.num_free_rows == 1
    assert t.pages(r0).tolist() == [5, 2] and t.table[r0, 2:].tolist() == [0, 0]
    pos = np.array([0, 15, 16, 31])
    assert t.slots(r0, pos, 16).tolist() == [80, 95, 32, 47]
    t.release(r0)
    assert t.num_free_rows == 2 and t.table[r0].tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError):
        t.assign([1, 2, 3, 4, 5])
    t.assign([4])
    t.assign([6])
    with pytest.raises(RuntimeError):
        t.assign([8])


def test_slots_for_matches_definition_randomly() -> None:
    rng = np.random.default_rng(1)
    for ps in (1, 2, 16, 64):
        row = rng.permutation(1000)[:20].astype(np.int32)
        pos = rng.integers(0, 20 * ps, size=50)
        want = [int(row[p // ps]) * ps + p % ps for p in pos]
        assert slots_for(row, pos, ps).tolist() == want


def test_pages_for() -> None:
    assert [pages_for(n, 64) for n in (0, 1, 64, 65, 730, 768, 769)] == [0, 1, 1, 2, 12, 12, 13]


def test_buckets() -> None:
    b = validate_buckets([1, 2, 4, 8, 16, 32, 48, 64])
    assert [pick_bucket(n, b) for n in (0, 1, 3, 8, 33, 48, 49, 64)] == [1, 1, 4, 8, 48, 48, 64, 64]
    with pytest.raises(BucketError, match="largest"):
        pick_bucket(65, b)
    with pytest.raises(BucketError):
        pick_bucket(-1, b)
    for bad in ([], [0, 1], [4, 2], [2, 2]):
        with pytest.raises(BucketError):
            validate_buckets(bad)


def test_host_modules_do_not_import_jax() -> None:
    mods = [
        "buckets",
        "pages",
        "prefix_cache",
        "scheduler",
        "scheduler_config",
        "plan",
        "request",
        "fake_runner",
    ]
    code = "import sys\n" + "".join(f"import kestrel_jax.serving.{m}\n" for m in mods)
    code += "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if m.startswith('jax'))\n"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
