"""KV page allocator with reference counts, and the host mirror of the per-sequence page tables.

Layout shared with the kernels (pallas/paged_attention.py): per layer the KV pool is
`[num_pages, n_kv_heads, page_size, head_dim]` (head-major); position p of a sequence lives at flat slot
`table[p // page_size] * page_size + p % page_size`. Pages are plain ints in [0, num_pages).

Ownership: every holder (a live sequence, the prefix cache, a pending page copy) owns one
reference per page it holds. A page returns to the free list when its count drops to zero.
Pure Python + numpy (no JAX).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np


class PageAccountingError(RuntimeError):
    """A page's reference count went wrong (freeing a free page, sharing an unallocated one)."""


class DoubleFreeError(PageAccountingError):
    """A page was released more times than it was referenced."""


class OutOfPagesError(RuntimeError):
    """Not enough free (or reclaimable) pages for an allocation."""


class Reclaimer(Protocol):
    """Something holding pages it can give back under pressure (the prefix cache)."""

    def reclaimable(self) -> int:
        """Pages that reclaim() could free right now."""
        ...

    def reclaim(self, num_pages: int) -> int:
        """Frees at least num_pages if it can (fewer otherwise); returns the number freed."""
        ...


def pages_for(num_positions: int, page_size: int) -> int:
    """Pages needed to hold positions [0, num_positions)."""
    return -(-num_positions // page_size)


def slots_for(table_row: np.ndarray, positions: np.ndarray, page_size: int) -> np.ndarray:
    """Flat KV slots of `positions` for a sequence whose page-table row is `table_row`."""
    pos = np.asarray(positions, dtype=np.int64)
    return (table_row[pos // page_size].astype(np.int64) * page_size + pos % page_size).astype(np.int32)


class PageAllocator:
    """Reference-counted page pool. Allocation evicts from the reclaimer (if set) when short."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._refs = np.zeros(num_pages, dtype=np.int32)
        # A stack: pop() hands out low ids first on a fresh pool, and recently freed pages first
        # afterwards (order has no effect on correctness).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._reclaimer: Reclaimer | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def refcounts(self) -> np.ndarray:
        """Read-only view of the per-page reference counts, [num_pages] int32."""
        view = self._refs.view()
        view.flags.writeable = False
        return view

    def refcount(self, page: int) -> int:
        return int(self._refs[page])

    def set_reclaimer(self, reclaimer: Reclaimer | None) -> None:
        self._reclaimer = reclaimer

    def available(self) -> int:
        """Pages an allocation could obtain now: free ones plus what the reclaimer can evict."""
        extra = self._reclaimer.reclaimable() if self._reclaimer is not None else 0
        return len(self._free) + extra

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free) or n <= self.available()

    def allocate(self, n: int) -> list[int]:
        """n fresh pages with reference count 1. Raises OutOfPagesError without side effects on the
        free list when they cannot be found (evicted cache entries stay evicted)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free) and self._reclaimer is not None:
            self._reclaimer.reclaim(n - len(self._free))
        if n > len(self._free):
            raise OutOfPagesError(
                f"need {n} pages, {len(self._free)} free of {self.num_pages}; wait for running "
                "sequences to finish or enlarge the KV pool"
            )
        if n == 0:
            return []
        pages = self._free[-n:][::-1]
        del self._free[-n:]
        self._refs[pages] = 1
        return pages

    def _ids(self, pages: Iterable[int]) -> np.ndarray:
        ids = np.fromiter(pages, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_pages):
            raise PageAccountingError(f"page ids out of range [0, {self.num_pages}): {ids.tolist()}")
        return ids

    def incref(self, pages: Iterable[int]) -> None:
        """Adds one reference per occurrence; the pages must already be allocated."""
        ids = self._ids(pages)
        if not ids.size:
            return
        if (self._refs[ids] <= 0).any():
            bad = sorted({int(p) for p in ids if self._refs[p] <= 0})
            raise PageAccountingError(f"cannot share pages {bad}: they are not allocated")
        np.add.at(self._refs, ids, 1)

    def decref(self, pages: Iterable[int]) -> int:
        """Drops one reference per occurrence; returns how many pages became free."""
        ids = self._ids(pages)
        if not ids.size:
            return 0
        uniq, counts = np.unique(ids, return_counts=True)
        over = self._refs[uniq] < counts
        if over.any():
            raise DoubleFreeError(
                f"pages {uniq[over].tolist()} released more often than referenced "
                f"(refcounts {self._refs[uniq[over]].tolist()})"
            )
        self._refs[uniq] -= counts.astype(np.int32)
        freed = uniq[self._refs[uniq] == 0]
        self._free.extend(int(p) for p in freed)
        return int(freed.size)

    def check_leaks(self, expected_refs: np.ndarray | None = None) -> None:
        """Checks the free list against the counts, and (if given) the counts against what the
        holders say they hold. Raises PageAccountingError describing the first discrepancy."""
        free = np.asarray(self._free, dtype=np.int64)
        if np.unique(free).size != free.size:
            raise PageAccountingError("a page appears twice in the free list")
        if (self._refs < 0).any():
            raise PageAccountingError(f"negative refcounts on pages {np.flatnonzero(self._refs < 0).tolist()}")
        if free.size and (self._refs[free] != 0).any():
            raise PageAccountingError("a page in the free list still has references")
        if int((self._refs == 0).sum()) != free.size:
            raise PageAccountingError("a page with no references is missing from the free list (leak)")
        if expected_refs is not None:
            diff = np.flatnonzero(self._refs != expected_refs)
            if diff.size:
                raise PageAccountingError(
                    f"refcounts disagree with holders on pages {diff[:16].tolist()}: allocator "
                    f"{self._refs[diff[:16]].tolist()} vs holders {expected_refs[diff[:16]].tolist()}"
                )


class PageTables:
    """Host mirror of the page tables, `table [max_seqs, max_pages_per_seq] int32`.

    Each live sequence owns one row; entries past its page count are 0. Page 0 is a valid page,
    so those entries point at unrelated memory: kernels must mask by kv_len (they do).
    """

    def __init__(self, max_seqs: int, max_pages_per_seq: int) -> None:
        self.table = np.zeros((max_seqs, max_pages_per_seq), dtype=np.int32)
        self.num_pages = np.zeros(max_seqs, dtype=np.int32)  # [max_seqs] pages assigned per row
        self._free_rows: list[int] = list(range(max_seqs - 1, -1, -1))

    @property
    def max_pages_per_seq(self) -> int:
        return self.table.shape[1]

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def assign(self, pages: Sequence[int]) -> int:
        """Takes a free row for a sequence holding `pages` (in position order); returns the row."""
        if len(pages) > self.table.shape[1]:
            raise ValueError(f"{len(pages)} pages exceed max_pages_per_seq={self.table.shape[1]}")
        if not self._free_rows:
            raise RuntimeError("no free page-table row; raise max_running or wait")
        row = self._free_rows.pop()
        self.table[row, : len(pages)] = pages
        self.num_pages[row] = len(pages)
        return row

    def release(self, row: int) -> None:
        assert self.num_pages[row] >= 0 and row not in self._free_rows, f"row {row} released twice"
        self.table[row] = 0
        self.num_pages[row] = 0
        self._free_rows.append(row)

    def pages(self, row: int) -> np.ndarray:
        """The row's assigned pages, in position order (a view)."""
        return self.table[row, : self.num_pages[row]]

    def slots(self, row: int, positions: np.ndarray, page_size: int) -> np.ndarray:
        return slots_for(self.table[row], positions, page_size)
