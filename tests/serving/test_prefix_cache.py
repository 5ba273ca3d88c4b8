"""Prefix cache: keys, image-prefix sharing (with the straddling-page copy), prompt-page sharing,
isolation between images, LRU eviction. Scheduler-level tests run through the FakeRunner, which
checks that every position a sequence reads holds that sequence's own content."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kestrel_jax.serving.fake_runner import FakeRunner, assert_released, run_step, run_until_idle, submit
from kestrel_jax.serving.pages import PageAllocator
from kestrel_jax.serving.plan import PrefillPlan
from kestrel_jax.serving.prefix_cache import PrefixCache, prefix_keys
from kestrel_jax.serving.request import Request
from kestrel_jax.serving.scheduler import Scheduler
from kestrel_jax.serving.scheduler_config import SchedulerConfig

PRE = 730
Make = Callable[..., tuple[Scheduler, FakeRunner]]


@pytest.fixture
def make() -> Iterator[Make]:
    made: list[Scheduler] = []

    def _make(**kw: object) -> tuple[Scheduler, FakeRunner]:
        args: dict = dict(
            num_pages=256, page_size=64, max_seq_len=2048, decode_buckets=(1, 2, 4, 8), max_running=8,
            prefill_token_buckets=(64, 256, 1024, 2048), max_prefill_seqs=4,
        )  # fmt: skip
        args.update(kw)
        s = Scheduler(SchedulerConfig(**args))
        assert s.prefix_cache is not None or not args.get("enable_prefix_cache", True)
        cached = s.prefix_cache.cached_pages if s.prefix_cache is not None else None
        made.append(s)
        return s, FakeRunner(s.config.num_pages, s.config.page_size, cached_pages=cached)

    yield _make
    for s in made:
        s.check_invariants()
        assert_released(s)


def digest(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def key(image: str) -> bytes:
    k = prefix_keys(64, PRE, digest(image), None).image_key
    assert k is not None
    return k


def img_req(rid: str, image: str, tokens: list[int] | range, max_new: int = 4) -> Request:
    toks = tuple(tokens)
    return Request(rid, len(toks), max_new, image_digest=digest(image), prefix_len=PRE, prompt_tokens=toks)


def first_prefill_of(s: Scheduler, r: FakeRunner, rid: str) -> tuple[PrefillPlan, int]:
    """Steps until a prefill plan contains rid; returns it and rid's batch index."""
    for _ in range(100):
        out = run_step(s, r)
        assert out is not None, f"{rid} never prefilled"
        if isinstance(out.plan, PrefillPlan) and rid in out.plan.seq_ids:
            return out.plan, out.plan.seq_ids.index(rid)
    raise AssertionError("no prefill")


def test_keys_separate_images_and_follow_the_chain() -> None:
    toks = list(range(100, 300))
    a = prefix_keys(64, PRE, digest("a"), toks)
    b = prefix_keys(64, PRE, digest("b"), toks)
    assert a == prefix_keys(64, PRE, digest("a"), toks)
    assert a.image_key != b.image_key
    # Identical prompt tokens after different images: no key in common at all.
    assert not ({a.image_key, *a.page_keys} & {b.image_key, *b.page_keys})
    text = prefix_keys(64, 0, None, toks)
    assert text.image_key is None and not set(text.page_keys) & set(a.page_keys)
    assert len(a.page_keys) == (PRE + len(toks)) // 64 - PRE // 64 and a.first_page == 11 and a.has_tail
    changed = list(toks)
    changed[100] += 1  # position 830 -> page 12 (keys index 1)
    c = prefix_keys(64, PRE, digest("a"), changed)
    assert c.page_keys[0] == a.page_keys[0] and all(
        x != y for x, y in zip(c.page_keys[1:], a.page_keys[1:], strict=True)
    )
    assert prefix_keys(64, PRE, digest("a"), None).page_keys == ()
    assert prefix_keys(16, PRE, digest("a"), toks).image_key != a.image_key  # page size is part of the key


def test_insert_lookup_pins_and_tail_copy_source() -> None:
    alloc = PageAllocator(40, 64)
    cache = PrefixCache(alloc)
    keys = prefix_keys(64, PRE, digest("x"), None)
    seq_pages = alloc.allocate(12)
    assert cache.insert_image(keys, seq_pages)
    assert not cache.insert_image(keys, seq_pages)  # idempotent
    assert all(alloc.refcount(p) == 2 for p in seq_pages)  # cache ref (+ tail-copy pin on page 11)
    hit = cache.lookup(keys, PRE + 5)
    assert hit.cached_len == PRE and hit.shared_pages == tuple(seq_pages[:11])
    assert hit.copy_src == seq_pages[11], "while the tail copy is pending, hits copy from its source"
    assert all(alloc.refcount(p) == 3 for p in seq_pages)
    cache.release(hit)
    ((src, tail),) = cache.take_copies()
    assert src == seq_pages[11] and tail not in seq_pages
    cache.copies_done()
    assert alloc.refcount(seq_pages[11]) == 1
    hit2 = cache.lookup(keys, PRE + 5)
    assert hit2.copy_src == tail
    cache.release(hit2)
    alloc.decref(seq_pages)
    assert cache.reclaimable() == 12
    cache.clear()
    assert alloc.num_free == 40


def test_eviction_drops_a_pending_tail_copy_and_its_pin() -> None:
    alloc = PageAllocator(30, 64)
    cache = PrefixCache(alloc)
    seq_pages = alloc.allocate(12)
    cache.insert_image(prefix_keys(64, PRE, digest("x"), None), seq_pages)
    alloc.decref(seq_pages)  # the sequence ended before any plan carried the copy
    assert cache.reclaimable() == 13  # 11 image pages + tail + the pinned copy source
    assert cache.reclaim(13) == 13
    assert alloc.num_free == 30 and cache.take_copies() == [] and len(cache) == 0


@pytest.mark.parametrize("page_size", [16, 64, 128])
def test_second_question_on_an_image_prefills_only_its_prompt(make: Make, page_size: int) -> None:
    s, r = make(page_size=page_size)
    submit(s, r, img_req("a", "cat", range(20)))
    plan, b = first_prefill_of(s, r, "a")
    assert plan.context_lens[b] == 0 and plan.kv_lens[b] == PRE + 20 and plan.positions[0] == 0
    submit(s, r, img_req("b", "cat", range(500, 530)))
    plan, b = first_prefill_of(s, r, "b")
    lo, hi = plan.cu_q_lens[b], plan.cu_q_lens[b + 1]
    assert plan.context_lens[b] == PRE and hi - lo == 30
    assert plan.positions[lo:hi].tolist() == list(range(PRE, PRE + 30))
    # One copy fills b's straddling page; a second fills the cache's own tail page.
    assert plan.num_copies == 2 and plan.copies[:2, 0].tolist() == [plan.copies[0, 0]] * 2
    run_until_idle(s, r)
    submit(s, r, img_req("c", "cat", range(900, 910)))
    plan, b = first_prefill_of(s, r, "c")
    assert plan.context_lens[b] == PRE and plan.num_copies == 1  # now copied from the tail page
    ended = {f.request_id: f for f in run_until_idle(s, r)}
    assert ended["c"].metrics.cached_tokens == PRE


def test_page_multiple_prefix_needs_no_copy(make: Make) -> None:
    s, r = make(page_size=2, max_seq_len=1024, num_pages=2048, prefill_token_buckets=(1024,))
    submit(s, r, img_req("a", "cat", range(7)))
    run_until_idle(s, r)
    submit(s, r, img_req("b", "cat", range(50, 60)))
    plan, b = first_prefill_of(s, r, "b")
    assert plan.context_lens[b] == PRE and plan.num_copies == 0
    run_until_idle(s, r)


def test_same_image_submitted_together_is_encoded_once(make: Make) -> None:
    s, r = make()
    for i in range(3):
        submit(s, r, img_req(f"q{i}", "dog", range(10 * i, 10 * i + 12)))
    first = run_step(s, r)
    assert first is not None and isinstance(first.plan, PrefillPlan)
    assert first.plan.seq_ids[: first.plan.num_seqs] == ("q0",) and first.plan.num_tokens == PRE + 12
    second = run_step(s, r)
    assert second is not None and isinstance(second.plan, PrefillPlan)
    assert second.plan.seq_ids[:2] == ("q1", "q2") and second.plan.context_lens[:2].tolist() == [PRE, PRE]
    assert second.plan.num_tokens == 24
    run_until_idle(s, r)
    assert s.stats.cached_tokens == 2 * PRE


def test_different_images_never_share(make: Make) -> None:
    s, r = make()
    toks = list(range(40))  # same prompt tokens: only the image differs
    submit(s, r, img_req("a", "cat", toks))
    run_until_idle(s, r)
    assert s.prefix_cache is not None
    a_pages = s.prefix_cache.cached_pages()
    submit(s, r, img_req("b", "dog", toks))
    plan, b = first_prefill_of(s, r, "b")
    assert plan.context_lens[b] == 0 and plan.kv_lens[b] == PRE + 40 and plan.num_copies == 0
    assert not set(plan.page_table[b, :12].tolist()) & a_pages
    run_until_idle(s, r)
    # A text-only request with the same tokens shares nothing with either image either.
    submit(s, r, Request("t", 40, 3, prompt_tokens=tuple(toks)))
    plan, b = first_prefill_of(s, r, "t")
    assert plan.context_lens[b] == 0
    run_until_idle(s, r)


def test_straddling_page_is_shared_when_leading_prompt_matches(make: Make) -> None:
    s, r = make()
    common = list(range(1000, 1060))  # fills page 11 (38 prompt tokens) and part of page 12
    submit(s, r, img_req("a", "cat", [*common, 1, 2, 3]))
    run_until_idle(s, r)
    submit(s, r, img_req("b", "cat", [*common, 7, 8, 9, 10]))
    plan, b = first_prefill_of(s, r, "b")
    assert plan.context_lens[b] == 768 and plan.num_copies == 0
    assert plan.positions[plan.cu_q_lens[b]] == 768
    run_until_idle(s, r)


def test_hit_leaves_the_last_prompt_token_to_compute(make: Make) -> None:
    s, r = make()
    toks = list(range(102))  # 730 + 102 = 832 = 13 full pages
    submit(s, r, img_req("a", "cat", toks))
    run_until_idle(s, r)
    submit(s, r, img_req("b", "cat", toks))
    plan, b = first_prefill_of(s, r, "b")
    assert plan.context_lens[b] == 768 and plan.kv_lens[b] == 832
    assert plan.logits_rows[b] == plan.cu_q_lens[b + 1] - 1
    run_until_idle(s, r)
    submit(s, r, Request("t1", 128, 2, prompt_tokens=tuple(range(128))))
    run_until_idle(s, r)
    submit(s, r, Request("t2", 128, 2, prompt_tokens=tuple(range(128))))
    plan, b = first_prefill_of(s, r, "t2")
    assert plan.context_lens[b] == 64 and plan.kv_lens[b] == 128
    run_until_idle(s, r)


def test_partially_filled_and_generated_pages_are_not_cached(make: Make) -> None:
    s, r = make()
    submit(s, r, Request("a", 100, 60, prompt_tokens=tuple(range(100))))  # page 1 only partly prompt
    run_until_idle(s, r)
    assert s.prefix_cache is not None and len(s.prefix_cache) == 1  # page 0 only, never page 1 or 2
    submit(s, r, Request("b", 100, 2, prompt_tokens=tuple(range(100))))
    plan, b = first_prefill_of(s, r, "b")
    assert plan.context_lens[b] == 64
    run_until_idle(s, r)


def test_prompt_pages_without_token_ids_are_not_shared(make: Make) -> None:
    s, r = make()
    submit(s, r, Request("a", 200, 2))
    run_until_idle(s, r)
    submit(s, r, Request("b", 200, 2))
    plan, b = first_prefill_of(s, r, "b")
    assert plan.context_lens[b] == 0
    run_until_idle(s, r)


def test_lru_eviction_under_pressure(make: Make) -> None:
    # Each image request reserves 12 pages (730 + 10 + 3 positions); each cached image keeps 12.
    s, r = make(num_pages=40)
    cache = s.prefix_cache
    assert cache is not None

    def ask(rid: str, image: str) -> int:
        submit(s, r, img_req(rid, image, range(10), max_new=4))
        plan, b = first_prefill_of(s, r, rid)
        run_until_idle(s, r)
        return int(plan.context_lens[b])

    assert [ask("a", "one"), ask("b", "two"), ask("c", "three")] == [0, 0, 0]
    assert cache.num_pages_held() == 36 and s.allocator.num_free == 4
    assert ask("d", "one") == PRE  # touches "one": "two" is now least recently used
    assert ask("e", "four") == 0  # needs 12 pages: evicts "two" only
    assert [cache.contains_image(key(n)) for n in ("one", "two", "three", "four")] == [True, False, True, True]
    assert cache.stats.evicted_pages == 12
    assert ask("f", "two") == 0


def test_pages_in_use_are_never_evicted(make: Make) -> None:
    s, r = make(num_pages=26)
    cache = s.prefix_cache
    assert cache is not None
    submit(s, r, img_req("z", "zero", range(10), max_new=4))  # reserves 12 pages, caches 12
    run_until_idle(s, r)
    submit(s, r, img_req("a", "one", range(10), max_new=50))  # reserves 13, caches 11 of them + a tail
    run_step(s, r)
    assert s.allocator.num_free == 0
    submit(s, r, img_req("b", "two", range(10), max_new=4))  # needs 12: only "zero" may go
    run_step(s, r)
    assert not cache.contains_image(key("zero")) and cache.contains_image(key("one"))
    # b's own prefix finds no page for its tail copy ("one" is in use): it is simply not cached.
    assert not cache.contains_image(key("two"))
    assert cache.stats.evicted_pages == 12
    run_until_idle(s, r)
    submit(s, r, img_req("c", "one", range(5), max_new=2))
    plan, b = first_prefill_of(s, r, "c")
    assert plan.context_lens[b] == PRE
    run_until_idle(s, r)


def test_cache_disabled_recomputes_the_prefix(make: Make) -> None:
    s, r = make(enable_prefix_cache=False)
    submit(s, r, img_req("a", "cat", range(5)))
    run_until_idle(s, r)
    submit(s, r, img_req("b", "cat", range(5)))
    plan, b = first_prefill_of(s, r, "b")
    assert plan.context_lens[b] == 0 and plan.num_copies == 0
    run_until_idle(s, r)
    assert s.allocator.num_used == 0 and np.all(s.allocator.refcounts == 0)


def test_evictable_set_matches_a_page_by_page_scan_through_many_evictions() -> None:
    """The flat index eviction checks (appended at insertion, evicted rows compacted away once they
    are half of it) agrees with the definition after every operation of a random run long enough
    to compact several times: entries whose every page only the cache holds, minus those whose
    tail copy is in flight."""
    rng = np.random.default_rng()
    alloc = PageAllocator(96, 64)
    cache = PrefixCache(alloc)
    held: list[list[int]] = []  # pages "sequences" hold besides the cache

    def brute() -> set[int]:
        busy = {id(c.entry) for c in cache._in_flight if c.entry is not None}
        return {id(e) for e in cache._entries.values()
                if id(e) not in busy and all(alloc.refcount(p) == 1 for p in e.pages)}

    compactions = 0
    for step in range(600):
        op = rng.integers(0, 5)
        if op <= 1 and alloc.can_allocate(13):  # a sequence prefills an image: 12 pages, cached
            pages = alloc.allocate(13)
            keys = prefix_keys(64, PRE, digest(f"img{step}"), None)
            cache.insert_image(keys, pages)
            held.append(pages)
        elif op == 2 and alloc.can_allocate(1):  # a prompt page, cached
            (page,) = alloc.allocate(1)
            cache.insert_page(digest(f"page{step}"), page, depth=int(rng.integers(1, 4)))
            held.append([page])
        elif op == 3 and held:  # a sequence ends
            alloc.decref(held.pop(int(rng.integers(len(held)))))
        elif op == 4:  # a plan with the pending copies runs
            cache.take_copies()
            if rng.random() < 0.5:
                assert {id(e) for e in cache._evictable()} == brute()  # while copies are in flight
            cache.copies_done()
        before = len(cache._flat.entries)
        assert {id(e) for e in cache._evictable()} == brute()
        compactions += len(cache._flat.entries) < before
        assert cache.reclaimable() >= sum(len(e.pages) for e in cache._evictable())
    assert compactions >= 1
    for pages in held:
        alloc.decref(pages)
    cache.clear()
    alloc.check_leaks()
    assert alloc.num_free == alloc.num_pages


def test_copies_flushed_after_the_commit_that_made_them(make: Make) -> None:
    """The engine dispatches an image entry's tail copy right after the launch whose commit cached
    the image (Scheduler.flush_copies), not with the next plan: later plans carry only hits' copies,
    which then read the cache's tail page, and every position still reads its own content (the
    FakeRunner checks)."""
    s, r = make()
    submit(s, r, img_req("a", "cat", range(20)))
    plan = s.schedule()
    assert plan is not None
    with pytest.raises(Exception, match="flush_copies"):
        s.flush_copies()  # only between a commit and the next schedule
    r.run(plan)
    s.commit(plan)
    copies, n = s.flush_copies()
    assert n == 1 and copies[0, 0] == plan.page_table[0, PRE // 64]  # a's straddling page -> the tail
    r.copy_pages(copies, n)
    assert s.flush_copies()[1] == 0  # taken once
    run_until_idle(s, r, flush_copies=True)
    submit(s, r, img_req("b", "cat", range(500, 530)))
    plan_b, b = first_prefill_of(s, r, "b")
    assert s.prefix_cache is not None
    tail = s.prefix_cache._entries[key("cat")].tail
    assert plan_b.context_lens[b] == PRE and plan_b.num_copies == 1 and plan_b.copies[0, 0] == tail
    # many images at once, flushed as the engine does; the FakeRunner checks every read
    for i in range(12):
        submit(s, r, img_req(f"m{i}", ["cat", "dog", "eel"][i % 3], range(7 * i, 7 * i + 9)))
    ended = run_until_idle(s, r, flush_copies=True)
    assert sum(f.metrics.cached_tokens == PRE for f in ended) >= 9
