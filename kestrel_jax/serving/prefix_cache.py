"""Prefix cache: shares full KV pages of [BOS + image] + prompt tokens across requests.

Keys form a hash chain and never depend on position alone:
  image key  = H("image", prefix_len, page_size, image digest)
  page key_i = H(key_{i-1}, token ids the page holds), starting from the image key (or from a
               fixed text root for text-only requests).
KV at a position depends on everything before it (and, inside the image prefix, on the whole
image), which is exactly what the chain covers; two different images never share a key.

The image prefix rule. The 730 prefix positions attend to each other bidirectionally, so a
partial prefix can never be extended: a hit covers the whole prefix or none of it. With
page_size S, the prefix fills 730 // S full pages plus a "straddling" page whose first
730 % S rows are image and whose remaining rows belong to the prompt of whichever request
wrote it. One image entry therefore holds:
  - the full image pages, shared by reference, and
  - a private "tail" page: a copy of the straddling page taken right after the first prefill
    (rows past 730 % S are junk nobody reads).
A request hitting the image gets the full pages by reference plus a fresh page initialised by
copying the tail (a page copy in its first plan), then prefills only its prompt from position
730. If the straddling page of an earlier request with the same leading prompt tokens is
cached (key = image key + those tokens), it is shared by reference instead and no copy is made.
Cached prompt pages follow the chain; only pages whose every row is prompt/prefix content and
already computed are inserted (a partially filled page would be written by the next token).
A hit never covers the whole prompt: at least the last prompt token is recomputed to produce
logits, dropping whole pages from the hit as needed.

Copies and pins: a pending copy holds a reference on its source page until the plan that
carries it has been committed, so the source cannot be reused before the copy has run. While
the tail copy of an image entry is pending, hits copy from its source page instead of the
tail, so no copy in a plan reads a page another copy in the same plan writes.

Eviction: LRU over entries whose pages are referenced by nobody but the cache, oldest first
and deepest first among equals (children before the entries they extend), triggered by the
allocator when an allocation is short of free pages. Pure Python + numpy (no JAX).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kestrel_jax.serving.pages import OutOfPagesError, PageAllocator

_IMAGE_DOMAIN = b"kestrel-jax/prefix/image/v1"
_TEXT_DOMAIN = b"kestrel-jax/prefix/text/v1"


def _h(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.digest()


@dataclass(frozen=True)
class PrefixKeys:
    """Cache keys of one request, computed once at add()."""

    prefix_len: int
    image_key: bytes | None  # None for text-only requests
    image_pages: int  # full pages wholly inside the image prefix (prefix_len // page_size)
    has_tail: bool  # prefix_len % page_size != 0: page `image_pages` straddles prefix and prompt
    first_page: int  # page index of page_keys[0] (== image_pages)
    page_keys: tuple[bytes, ...]  # chained keys of the full pages holding prompt tokens


def prefix_keys(
    page_size: int, prefix_len: int, image_digest: bytes | None, prompt_tokens: Sequence[int] | None
) -> PrefixKeys:
    """Keys for a request; prompt pages get keys only when the token ids are known."""
    if image_digest is not None:
        root = _h(_IMAGE_DOMAIN, prefix_len.to_bytes(8, "little"), page_size.to_bytes(8, "little"), image_digest)
        image_key: bytes | None = root
    else:
        root = _h(_TEXT_DOMAIN, page_size.to_bytes(8, "little"))
        image_key = None
    image_pages, tail = divmod(prefix_len, page_size)
    keys: list[bytes] = []
    if prompt_tokens is not None:
        toks = np.asarray(prompt_tokens, dtype="<i8")
        total = prefix_len + toks.size
        parent = root
        for i in range(image_pages, total // page_size):
            lo = max(0, i * page_size - prefix_len)
            parent = _h(parent, toks[lo : (i + 1) * page_size - prefix_len].tobytes())
            keys.append(parent)
    return PrefixKeys(prefix_len, image_key, image_pages, tail != 0, image_pages, tuple(keys))


@dataclass(frozen=True)
class PrefixHit:
    cached_len: int  # positions whose KV is reused; 0 = miss
    shared_pages: tuple[int, ...]  # the sequence's pages [0, k), used as they are (pinned)
    copy_src: int | None  # page k must start as a copy of this page (image tail; pinned)


MISS = PrefixHit(0, (), None)


@dataclass(eq=False)
class _Entry:
    key: bytes
    pages: tuple[int, ...]  # image entry: full image pages + tail page; prompt entry: one page
    depth: int  # 0 for image entries, page index + 1 for prompt pages
    last_used: int
    tail: int | None = None  # image entries with a straddling page: the private tail copy
    tail_src: int | None = None  # while the tail copy is pending: the page copied from


@dataclass(eq=False)
class _Copy:
    src: int  # pinned by one reference until the carrying plan commits
    dst: int
    entry: _Entry | None  # image entry whose tail this fills, if any


@dataclass
class PrefixCacheStats:
    lookups: int = 0  # includes retries of requests that waited for KV
    # hits and hit_tokens count only hits that were used (released hits are taken back)
    hits: int = 0
    hit_tokens: int = 0
    inserted_pages: int = 0
    evicted_pages: int = 0


class _FlatEntries:
    """The cache's entries in insertion order with their pages in flat arrays, for checking all of
    them against the reference counts at once. Insertions are appended at the next `sync`;
    evicted entries are marked dead and dropped once they are half of the rows."""

    def __init__(self) -> None:
        self.entries: list[_Entry] = []
        self.pos: dict[int, int] = {}  # id(entry) -> row
        self.pages = np.zeros(0, np.int64)  # every row's pages, concatenated
        self.starts = np.zeros(0, np.int64)  # row -> first index into pages
        self.lens = np.zeros(0, np.int64)
        self.dead = np.zeros(0, bool)
        self._new: list[_Entry] = []

    def add(self, entry: _Entry) -> None:
        self._new.append(entry)

    def remove(self, entry: _Entry) -> None:
        row = self.pos.pop(id(entry), None)
        if row is None:
            self._new.remove(entry)
        else:
            self.dead[row] = True

    def sync(self) -> None:
        n_dead = len(self.entries) - len(self.pos)
        if n_dead > 32 and 2 * n_dead > len(self.entries):
            keep = ~self.dead
            self.pages = self.pages[np.repeat(keep, self.lens)]
            self.entries = [e for e, k in zip(self.entries, keep.tolist(), strict=True) if k]
            self.lens = self.lens[keep]
            self.dead = self.dead[keep]
            self.starts = np.zeros(len(self.entries), np.int64)
            np.cumsum(self.lens[:-1], out=self.starts[1:])
            self.pos = {id(e): i for i, e in enumerate(self.entries)}
        if self._new:
            new, self._new = self._new, []
            lens = np.fromiter((len(e.pages) for e in new), np.int64, len(new))
            pages = np.fromiter((p for e in new for p in e.pages), np.int64, int(lens.sum()))
            self.starts = np.concatenate([self.starts, self.pages.size + np.cumsum(lens) - lens])
            self.pages = np.concatenate([self.pages, pages])
            self.lens = np.concatenate([self.lens, lens])
            self.dead = np.concatenate([self.dead, np.zeros(len(new), bool)])
            for e in new:
                self.pos[id(e)] = len(self.entries)
                self.entries.append(e)


class PrefixCache:
    """Holds one reference on every page of every entry; registers itself as the allocator's
    reclaimer so allocations evict unreferenced entries when the free list runs short."""

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self._entries: dict[bytes, _Entry] = {}
        self._tick = 0
        self._pending: list[_Copy] = []  # not yet in a plan
        self._in_flight: list[_Copy] = []  # in the plan being executed
        # The entries' pages flattened for eviction, which checks every entry's pages against the
        # reference counts at every admission once cached images fill the pool (a Python scan of
        # each page took 3.0 ms per step launch in W2 on the GPU machine, 3.6 ms per step in
        # tools/bench_scheduler.py with ~384 cached images: BENCHMARKS.md, twenty-seventh session).
        self._flat = _FlatEntries()
        self.stats = PrefixCacheStats()
        allocator.set_reclaimer(self)

    def __len__(self) -> int:
        return len(self._entries)

    def contains_image(self, image_key: bytes) -> bool:
        return image_key in self._entries

    def cached_pages(self) -> set[int]:
        """Pages held by entries (KV writes must never target them)."""
        return {p for e in self._entries.values() for p in e.pages}

    def num_pages_held(self) -> int:
        return sum(len(e.pages) for e in self._entries.values())

    # -- lookup ------------------------------------------------------------------------------

    def lookup(self, keys: PrefixKeys, prompt_total: int) -> PrefixHit:
        """Longest cached run of full pages for a request; pins what it returns (one reference
        per shared page and on copy_src). Hand the hit to the sequence, or call release()."""
        self.stats.lookups += 1
        self._tick += 1
        matched: list[_Entry] = []
        shared: list[int] = []
        if keys.image_key is not None:
            img = self._entries.get(keys.image_key)
            if img is None:
                return MISS
            matched.append(img)
            shared.extend(img.pages[: keys.image_pages])
        n_prompt = 0
        for key in keys.page_keys:
            entry = self._entries.get(key)
            if entry is None:
                break
            matched.append(entry)
            n_prompt += 1
        # Keep at least the last prompt token to compute (it produces the first logits).
        while n_prompt and (keys.first_page + n_prompt) * self.page_size >= prompt_total:
            n_prompt -= 1
            matched.pop()
        if keys.image_key is None and n_prompt == 0:
            return MISS
        shared.extend(e.pages[0] for e in matched[len(matched) - n_prompt :])
        copy_src: int | None = None
        if n_prompt:
            cached = (keys.first_page + n_prompt) * self.page_size
        else:
            cached = keys.prefix_len
            if keys.has_tail:
                img = matched[0]
                copy_src = img.tail_src if img.tail_src is not None else img.tail
                assert copy_src is not None, "image entry with a straddling page lacks its tail"
        for e in matched:
            e.last_used = self._tick
        self.allocator.incref(shared + ([copy_src] if copy_src is not None else []))
        self.stats.hits += 1
        self.stats.hit_tokens += cached
        return PrefixHit(cached, tuple(shared), copy_src)

    def release(self, hit: PrefixHit) -> None:
        """Drops the pins of a hit that was not used (admission failed)."""
        pinned = list(hit.shared_pages) + ([hit.copy_src] if hit.copy_src is not None else [])
        self.allocator.decref(pinned)
        if hit.cached_len:
            self.stats.hits -= 1
            self.stats.hit_tokens -= hit.cached_len

    def add_copy(self, src: int, dst: int) -> None:
        """Schedules a hit's page copy; takes over the pin on src that lookup() made."""
        self._pending.append(_Copy(src, dst, None))

    # -- insertion ---------------------------------------------------------------------------

    def insert_image(self, keys: PrefixKeys, seq_pages: Sequence[int]) -> bool:
        """Caches the image prefix of a sequence that has just prefilled it (its pages in position
        order). Returns False when already cached or when no page is left for the tail copy."""
        assert keys.image_key is not None
        self._tick += 1
        existing = self._entries.get(keys.image_key)
        if existing is not None:
            existing.last_used = self._tick
            return False
        full = tuple(int(p) for p in seq_pages[: keys.image_pages])
        tail: int | None = None
        tail_src: int | None = None
        if keys.has_tail:
            try:
                (tail,) = self.allocator.allocate(1)
            except OutOfPagesError:
                return False
            tail_src = int(seq_pages[keys.image_pages])
            self.allocator.incref([tail_src])  # pin until the copy has run
        self.allocator.incref(full)
        pages = full + ((tail,) if tail is not None else ())
        entry = _Entry(keys.image_key, pages, 0, self._tick, tail, tail_src)
        self._entries[keys.image_key] = entry
        self._flat.add(entry)
        if tail is not None and tail_src is not None:
            self._pending.append(_Copy(tail_src, tail, entry))
        self.stats.inserted_pages += len(pages)
        return True

    def insert_page(self, key: bytes, page: int, depth: int) -> bool:
        """Caches one full, computed page under its chain key; False when the key is present."""
        self._tick += 1
        existing = self._entries.get(key)
        if existing is not None:
            existing.last_used = self._tick
            return False
        self.allocator.incref([page])
        self._entries[key] = entry = _Entry(key, (int(page),), depth, self._tick)
        self._flat.add(entry)
        self.stats.inserted_pages += 1
        return True

    # -- copies ------------------------------------------------------------------------------

    def take_copies(self) -> list[tuple[int, int]]:
        """Moves the pending copies into the plan being built; (src, dst) pairs."""
        assert not self._in_flight, "previous plan's copies were never committed"
        self._in_flight, self._pending = self._pending, []
        return [(c.src, c.dst) for c in self._in_flight]

    def copies_done(self) -> None:
        """The plan carrying the in-flight copies has run: unpin sources, tails become readable."""
        for c in self._in_flight:
            if c.entry is not None:
                c.entry.tail_src = None
            self.allocator.decref([c.src])
        self._in_flight = []

    # -- eviction ----------------------------------------------------------------------------

    def _evictable_mask(self) -> np.ndarray:
        """Over `self._flat.entries`: live entries whose every page only the cache references,
        but for those whose tail copy is in the plan being executed."""
        f = self._flat
        f.sync()
        shared = np.concatenate([[0], np.cumsum(self.allocator.refcounts[f.pages] != 1)])
        mask = (shared[f.starts + f.lens] == shared[f.starts]) & ~f.dead  # no page held by anyone else
        for c in self._in_flight:
            if c.entry is not None and id(c.entry) in f.pos:
                mask[f.pos[id(c.entry)]] = False
        return mask

    def _evictable(self) -> list[_Entry]:
        return [self._flat.entries[i] for i in np.flatnonzero(self._evictable_mask())]

    def reclaimable(self) -> int:
        """Pages that evicting every evictable entry would free, including the source pages of
        their pending tail copies when nothing else holds them."""
        refs = self.allocator.refcounts
        mask = self._evictable_mask()
        f = self._flat
        pinned_only = sum(1 for c in self._pending if c.entry is not None and id(c.entry) in f.pos
                          and mask[f.pos[id(c.entry)]] and refs[c.src] == 1)
        return int(f.lens[mask].sum()) + pinned_only

    def reclaim(self, num_pages: int) -> int:
        freed = 0
        for e in sorted(self._evictable(), key=lambda e: (e.last_used, -e.depth)):
            if freed >= num_pages:
                break
            freed += self._evict(e)
        return freed

    def _evict(self, entry: _Entry) -> int:
        del self._entries[entry.key]
        self._flat.remove(entry)
        freed = self.allocator.decref(entry.pages)
        for c in [c for c in self._pending if c.entry is entry]:
            self._pending.remove(c)
            freed += self.allocator.decref([c.src])
        self.stats.evicted_pages += len(entry.pages)
        return freed

    def clear(self) -> None:
        """Drops every entry and pending copy (pages still used by sequences stay allocated)."""
        if self._in_flight:
            raise RuntimeError("cannot clear the prefix cache while a plan with its copies is in flight")
        for c in self._pending:
            self.allocator.decref([c.src])
        self._pending = []
        for e in list(self._entries.values()):
            self.allocator.decref(e.pages)
        self._entries.clear()
        self._flat = _FlatEntries()

    def add_held_refs(self, counts: np.ndarray) -> None:
        """Adds the references the cache holds (entries and copy pins) to `counts` [num_pages]."""
        for e in self._entries.values():
            np.add.at(counts, list(e.pages), 1)
        for c in self._pending + self._in_flight:
            counts[c.src] += 1
