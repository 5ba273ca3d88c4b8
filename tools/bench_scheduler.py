#!/usr/bin/env python3
"""Host time of the scheduler alone (CPU, no JAX): a W2-shaped closed loop of image queries driven
through `Scheduler.schedule` / `commit` with no device, timing `schedule()` per step.

Every request brings a new image (prefix 730 + a short prompt, 128 answer tokens by default), so
the prefix cache keeps the KV pool full of cached images and every admission evicts: the regime in
which eviction checks ran on the engine thread's critical path (BENCHMARKS.md, twenty-seventh
session: 3.6 -> 0.4 ms per step).

  python tools/bench_scheduler.py                      # 64 clients, 4,800 pages of 64
  python tools/bench_scheduler.py --clients 8 --steps 300 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel_jax.serving.request import Request  # noqa: E402
from kestrel_jax.serving.scheduler import Scheduler  # noqa: E402
from kestrel_jax.serving.scheduler_config import SchedulerConfig  # noqa: E402


def drive(a: argparse.Namespace) -> dict[str, Any]:
    cfg = SchedulerConfig(num_pages=a.pages, page_size=a.page_size, max_seq_len=2048, decode_buckets=(1, a.clients),
                          prefill_token_buckets=(768, 1536, 2048), max_prefill_seqs=8, image_prefix_len=730,
                          enable_prefix_cache=True, mixed_decode_buckets=(a.clients,))
    s = Scheduler(cfg)
    rng = np.random.default_rng(a.seed)
    ids = iter(range(1 << 62))

    def new() -> None:
        s.add(Request(request_id=next(ids), prompt_len=a.prompt, max_new_tokens=a.max_tokens,
                      image_digest=rng.bytes(32), prefix_len=730,
                      prompt_tokens=tuple(int(x) for x in rng.integers(1, 50_000, a.prompt))))

    for _ in range(a.clients):
        new()
    finished = 0

    def run(steps: int) -> float:
        nonlocal finished
        spent = 0.0
        for _ in range(steps):
            t0 = time.perf_counter()
            plan = s.schedule(a.decode_steps)
            spent += time.perf_counter() - t0
            if plan is None:
                raise RuntimeError("the scheduler planned nothing with clients waiting")
            s.commit(plan)
            for _ in s.take_finished():  # closed loop: each finished client asks again
                finished += 1
                new()
        return spent

    run(a.warmup)
    prof = cProfile.Profile() if a.profile else None
    if prof is not None:
        prof.enable()
    spent = run(a.steps)
    if prof is not None:
        prof.disable()
    cache = s.prefix_cache
    out: dict[str, Any] = {"schedule_ms_per_step": round(spent / a.steps * 1e3, 4), "steps": a.steps,
                           "finished": finished, "cached_entries": 0 if cache is None else len(cache),
                           "evicted_pages": 0 if cache is None else cache.stats.evicted_pages,
                           "free_pages": s.allocator.num_free, "settings": vars(a)}
    if prof is not None:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
        out["profile"] = text.getvalue()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--pages", type=int, default=4800)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=10, help="prompt tokens after the image prefix")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=300, help="steps before timing (the cache fills up)")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="cProfile the timed steps (slower; by own time)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    out = drive(a)
    print(f"schedule(): {out['schedule_ms_per_step']} ms per step over {out['steps']} steps; {out['finished']} "
          f"requests finished; {out['cached_entries']} cache entries, {out['evicted_pages']} pages evicted, "
          f"{out['free_pages']} free", flush=True)
    if "profile" in out:
        print(out["profile"])
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
