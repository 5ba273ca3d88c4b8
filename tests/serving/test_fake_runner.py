"""The FakeRunner must reject broken plans: each test takes a correct plan from the scheduler,
breaks one invariant, and expects PlanViolation (otherwise the scheduler tests prove nothing)."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest

from kestrel_jax.serving.fake_runner import FakeRunner, PlanViolation, assert_released, run_step, submit
from kestrel_jax.serving.plan import DecodePlan, PrefillPlan, StepPlan
from kestrel_jax.serving.request import Request
from kestrel_jax.serving.scheduler import Scheduler
from kestrel_jax.serving.scheduler_config import SchedulerConfig

PRE = 730


def setup(**kw: object) -> tuple[Scheduler, FakeRunner]:
    args: dict = dict(num_pages=128, page_size=64, max_seq_len=2048, decode_buckets=(1, 2, 4), max_running=4)
    args.update(kw)
    s = Scheduler(SchedulerConfig(**args))
    assert s.prefix_cache is not None
    return s, FakeRunner(128, 64, cached_pages=s.prefix_cache.cached_pages)


def img(rid: str, n: int = 10, max_new: int = 5) -> Request:
    return Request(rid, n, max_new, image_digest=hashlib.sha256(b"cat").digest(), prefix_len=PRE)


def edited(plan: StepPlan, field: str, fn: object) -> StepPlan:
    arr = np.array(getattr(plan, field))
    fn(arr)  # type: ignore[operator]
    return dataclasses.replace(plan, **{field: arr})  # type: ignore[arg-type]


def finish(s: Scheduler, plan: StepPlan) -> None:
    s.commit(plan)
    assert_released(s)


def test_untouched_plans_pass() -> None:
    s, r = setup()
    submit(s, r, img("a"))
    submit(s, r, Request("t", 70, 3))
    while run_step(s, r) is not None:
        pass
    assert_released(s)


@pytest.mark.parametrize(
    ("field", "fn", "match"),
    [
        ("slots", lambda a: a.__setitem__(1, a[0]), "same slot"),
        ("slots", lambda a: a.__setitem__(3, a[3] + 64 * 50), "not its pages"),
        ("positions", lambda a: a.__setitem__(slice(0, 5), a[:5] + 1), "do not continue"),
        ("slots", lambda a: a.__setitem__(-1, 7), "padding rows"),
        ("logits_rows", lambda a: a.__setitem__(0, -1), "logits row"),
    ],
)
def test_prefill_tampering_is_caught(field: str, fn: object, match: str) -> None:
    s, r = setup()
    submit(s, r, Request("t", 70, 3))
    plan = s.schedule()
    assert isinstance(plan, PrefillPlan)
    with pytest.raises(PlanViolation, match=match):
        r.run(edited(plan, field, fn))
    finish(s, plan)


def test_split_image_prefix_is_caught() -> None:
    s, r = setup()
    submit(s, r, img("a"))
    plan = s.schedule()
    assert isinstance(plan, PrefillPlan)
    short = dataclasses.replace(
        plan,
        cu_q_lens=np.array([0, 700] + [700] * (len(plan.cu_q_lens) - 2), np.int32),
        kv_lens=np.array([700] + [0] * (len(plan.kv_lens) - 1), np.int32),
        num_tokens=700,
        slots=np.where(np.arange(plan.bucket) < 700, plan.slots, -1).astype(np.int32),
        token_seq=np.where(np.arange(plan.bucket) < 700, plan.token_seq, -1).astype(np.int32),
        logits_rows=np.full_like(plan.logits_rows, -1),
    )
    with pytest.raises(PlanViolation, match="split"):
        r.run(short)
    finish(s, plan)


def test_missing_page_copy_is_caught() -> None:
    s, r = setup()
    submit(s, r, img("a"))
    run_step(s, r)
    submit(s, r, img("b"))
    plan = s.schedule()
    assert isinstance(plan, PrefillPlan) and plan.num_copies == 2
    no_copies = dataclasses.replace(plan, copies=np.full_like(plan.copies, -1), num_copies=0)
    with pytest.raises(PlanViolation, match="never written|foreign"):
        r.run(no_copies)
    finish(s, plan)


def test_corrupted_shared_prefix_is_caught() -> None:
    s, r = setup()
    submit(s, r, img("a"))
    run_step(s, r)
    submit(s, r, img("b"))
    plan = s.schedule()
    assert isinstance(plan, PrefillPlan)
    r.pool[5 * 64 + 3] += 1  # as if someone overwrote a cached image page
    with pytest.raises(PlanViolation, match="foreign or stale"):
        r.run(plan)
    finish(s, plan)


def test_decode_tampering_is_caught() -> None:
    s, r = setup()
    submit(s, r, Request("x", 30, 20))
    submit(s, r, Request("y", 40, 20))
    run_step(s, r)
    plan = s.schedule()
    assert isinstance(plan, DecodePlan) and plan.num_seqs == 2
    swapped = edited(plan, "page_table", lambda a: a.__setitem__(slice(0, 2), a[[1, 0]].copy()))
    with pytest.raises(PlanViolation, match="row changed"):
        r.run(swapped)
    with pytest.raises(PlanViolation, match="decode at"):
        r.run(edited(plan, "kv_lens", lambda a: a.__setitem__(0, a[0] + 1)))
    with pytest.raises(PlanViolation, match="padding"):
        r.run(dataclasses.replace(plan, seq_ids=("x", "y", "x", None)))
    finish(s, plan)


def test_write_into_cached_page_is_caught() -> None:
    s, _ = setup()
    protected: set[int] = set()
    r = FakeRunner(128, 64, cached_pages=lambda: protected)
    submit(s, r, Request("x", 30, 20))
    run_step(s, r)
    plan = s.schedule()
    assert isinstance(plan, DecodePlan)
    protected.add(int(plan.slots[0]) // 64)  # pretend the page x writes had been cached
    with pytest.raises(PlanViolation, match="prefix-cache pages"):
        r.run(plan)
    finish(s, plan)


def test_bad_copies_are_caught() -> None:
    s, r = setup()
    submit(s, r, Request("x", 30, 2))
    plan = s.schedule()
    assert plan is not None
    chained = np.full_like(plan.copies, -1)
    chained[:2] = [[1, 2], [2, 3]]  # a destination that is also a source
    with pytest.raises(PlanViolation, match="distinct destinations"):
        r.run(dataclasses.replace(plan, copies=chained, num_copies=2))
    finish(s, plan)


def test_mixed_step_tampering_is_caught() -> None:
    s, r = setup(mixed_decode_buckets=(2,))
    submit(s, r, Request("x", 30, 20))
    run_step(s, r)
    submit(s, r, Request("y", 40, 20))
    plan = s.schedule()
    assert isinstance(plan, PrefillPlan) and plan.decode is not None and plan.decode.num_seqs == 1
    late = edited(plan.decode, "kv_lens", lambda a: a.__setitem__(0, a[0] + 1))
    assert isinstance(late, DecodePlan)
    with pytest.raises(PlanViolation, match="decode at"):
        r.run(dataclasses.replace(plan, decode=late))
    twice = dataclasses.replace(plan.decode, seq_ids=("y", None))
    with pytest.raises(PlanViolation, match="both prefill and decode"):
        r.run(dataclasses.replace(plan, decode=twice))
    with pytest.raises(ValueError, match="one iteration"):
        dataclasses.replace(plan, decode=dataclasses.replace(plan.decode, steps=2))
    finish(s, plan)
