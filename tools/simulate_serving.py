#!/usr/bin/env python3
"""What a scheduling policy does to W2 (64 closed-loop clients sending new-image queries), on the
CPU, in simulated time: the real `Scheduler` plans every step, a cost model stands in for the
device, and the engine loop's order is kept (step N+1 scheduled and launched before step N is
read; a finished request's client asks again once the step that finished it is read).

The cost model's constants are H100 measurements of MD3 (FP8 experts and KV, BENCHMARKS.md
twenty-fifth to twenty-eighth sessions; `--cost KEY=VALUE` overrides them):

- decode iteration of b rows holding c KV positions in all: base + per_row * b
  + expert_ms * E(b) + kv_ns * c, with E(b) = 64 * (1 - (1 - 8/64)^b) experts read;
- prefill of n real tokens in a bucket of T: prefill_fixed + prefill_per_token * T
  + 20 layers * (moe_fixed_us + moe_per_token_us * n); a mixed step adds its decode rows'
  per-row and KV terms (the weights are read once for both);
- vision: vision_ms per image prefilled (the encoder shares the device);
- host: a launch costs the engine thread launch_ms[kind] plus schedule_ms before the device can
  start it (the device runs a step once it is launched and the previous step is done);
- optionally the vision worker thread (vision_launch_ms > 0): a prefill's launch waits until the
  worker has launched its images' encoding calls (batched as EncodeAhead batches them).

The point is the comparison between policies (decode iterations per launch, prefill budget and
buckets), which moves work between the states a request spends its life in; absolute figures
are as good as the constants. Calibrate against a measured W2 run first (the default constants
give its step counts and tokens/s within a few percent: see the printed `measured` line).

  python tools/simulate_serving.py                                  # the W2 settings
  python tools/simulate_serving.py --grid decode_steps=1:4:8 prefill_token_buckets=768,1536,2048:768,1536,2304
  python tools/simulate_serving.py --cost device_scale=0.88 vision_launch_ms=6.5 \
      --grid steps_policy=fixed:first_finish defer=0:1
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel_jax.serving.plan import DecodePlan, PrefillPlan, StepPlan  # noqa: E402
from kestrel_jax.serving.request import Request  # noqa: E402
from kestrel_jax.serving.scheduler import Scheduler  # noqa: E402
from kestrel_jax.serving.scheduler_config import SchedulerConfig  # noqa: E402

COST: dict[str, float] = {
    # decode iteration (ms): b=1 at ~1,000 positions is 1.37 ms (W1 731 tok/s); b=64 at 800 each 6.59
    # (probe decode K=1 10.17 ms minus its 3.58 ms pool copy), of which experts 3.0 and attention 1.96
    "decode_base_ms": 0.96,
    "decode_per_row_ms": 0.0106,
    "expert_ms": 3.0 / 64,  # 20 MoE layers' weights of one expert
    "kv_ns": 1.96e6 / (64 * 800),  # per KV position read, all 24 layers
    # prefill (ms): two 740-token prompts in the 1536 bucket 11.55 (probe, slices-fastest GEMMs);
    # the FP8 MoE layer 239.5 / 319.2 / 389.6 us at 740 / 1480 / 2048 tokens
    "prefill_fixed_ms": 0.5,
    "prefill_per_token_ms": 2.9e-3,
    "moe_fixed_us": 160.0,
    "moe_per_token_us": 0.11,
    "vision_ms": 1.86,  # per one-crop image, four per call
    # host (ms per launch; W2 call 1 of session 28: launch_mixed 3.5 s / 512, launch_decode 0.7 s / 226)
    "launch_mixed_ms": 7.0,
    "launch_prefill_ms": 5.0,
    "launch_decode_ms": 3.1,
    "schedule_ms": 1.5,
    "client_ms": 1.0,  # from a result read to its client's next request at the engine
    # the vision worker thread: launching one encoding call (up to vision_batch images) takes it
    # vision_launch_ms; it starts a call when vision_batch images are queued, when the engine asks
    # for a queued one, or vision_batch_wait_ms after the oldest was queued. A prefill's launch
    # waits for its images' calls to be launched (the device orders the rest). 0: no worker model.
    "vision_launch_ms": 0.0,
    "vision_batch": 4,
    "vision_batch_wait_ms": 30.0,
    "device_scale": 1.0,  # every device time times this (calibration to a measured run)
}


@dataclass
class Policy:
    decode_steps: int = 8
    prefill_token_buckets: tuple[int, ...] = (768, 1536, 2048)
    prefill_token_budget: int | None = None
    decode_buckets: tuple[int, ...] = (1, 64)
    max_prefill_seqs: int = 8
    # iterations per decode launch: "fixed" (decode_steps), "first_finish" (as the engine's
    # EngineConfig.decode_steps_to_finish: Scheduler.steps_to_first_finish)
    steps_policy: str = "fixed"
    # with the vision worker modelled: "drain" (an image is queued for encoding when the engine
    # thread takes its request from the inbox, as the engine does with admit_before_wait off),
    # "before_wait" (requests that arrived by the end of a launch are taken then, before the wait for
    # the previous step, their images queued as urgent: EngineConfig.admit_before_wait, the engine's
    # default since the thirty-second session) or "arrival" (queued when the
    # request arrives); defer: a prefill whose encoding is not launched yet is held back one step
    # (EngineConfig.defer_unready_images)
    encode_at: str = "drain"
    defer: int = 0

    def label(self) -> str:
        k = f"K={self.decode_steps}" + ("" if self.steps_policy == "fixed" else f"/{self.steps_policy}")
        k += "" if self.encode_at == "drain" else f" encode@{self.encode_at}"
        k += " defer" if self.defer else ""
        return (f"{k} buckets={','.join(map(str, self.prefill_token_buckets))}"
                + (f" budget={self.prefill_token_budget}" if self.prefill_token_budget else ""))


@dataclass
class Workload:
    clients: int = 64
    requests_per_client: int = 16
    prompt: int = 10  # tokens after the 730-token image prefix
    max_tokens: int = 128
    page_size: int = 64
    pages: int = 12_000
    seed: int = 0


@dataclass
class Result:
    wall_s: float = 0.0
    requests: int = 0
    output_tokens: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)
    device_busy_s: float = 0.0
    steps: dict[str, int] = field(default_factory=lambda: {"mixed": 0, "prefill": 0, "decode": 0})
    decode_iterations: int = 0
    decode_rows: int = 0
    image_wait_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "wall_s": round(self.wall_s, 3),
            "output_tok_s": round(self.output_tokens / self.wall_s, 1),
            "requests_per_s": round(self.requests / self.wall_s, 2),
            "ttft_ms_p50": round(float(np.percentile(self.ttft_ms, 50)), 1),
            "ttft_ms_p90": round(float(np.percentile(self.ttft_ms, 90)), 1),
            "latency_ms_p50": round(float(np.percentile(self.latency_ms, 50)), 1),
            "device_busy": round(self.device_busy_s / self.wall_s, 3),
            "steps": self.steps,
            "decode_iterations": self.decode_iterations,
            "mean_decode_batch": round(self.decode_rows / max(self.decode_iterations, 1), 2),
            "image_wait_s": round(self.image_wait_s, 3),
        }


def experts_read(rows: int) -> float:
    return 64.0 * (1.0 - (1.0 - 8.0 / 64.0) ** rows)


def decode_ms(c: dict[str, float], rows: int, kv_positions: int) -> float:
    return (c["decode_base_ms"] + c["decode_per_row_ms"] * rows + c["expert_ms"] * experts_read(rows)
            + c["kv_ns"] * kv_positions * 1e-6)


def prefill_ms(c: dict[str, float], bucket: int, tokens: int, images: int) -> float:
    moe = 20 * (c["moe_fixed_us"] + c["moe_per_token_us"] * tokens) * 1e-3
    return c["prefill_fixed_ms"] + c["prefill_per_token_ms"] * bucket + moe + c["vision_ms"] * images


def plan_cost(c: dict[str, float], plan: StepPlan) -> tuple[float, int, int]:
    """(device ms, decode iterations, decode rows) of one launched plan."""
    if isinstance(plan, DecodePlan):
        steps = plan.row_steps[: plan.num_seqs] if plan.row_steps is not None else np.ones(plan.num_seqs, np.int32)
        kv = plan.kv_lens[: plan.num_seqs].astype(np.int64)
        # a fixed-shape launch: every row computes every iteration (one whose row_steps are done
        # keeps attending at its last length, its writes dropped); rows counts the useful ones
        ms, rows, n = 0.0, 0, plan.num_seqs
        for i in range(plan.steps):
            ms += decode_ms(c, n, int((kv + np.minimum(i, np.maximum(steps - 1, 0))).sum()))
            rows += int((steps > i).sum())
        return ms, plan.steps, rows
    images = int(((plan.prefix_lens > 0) & (plan.context_lens == 0))[: plan.num_seqs].sum())
    ms = prefill_ms(c, len(plan.positions), plan.num_tokens, images)
    if plan.decode is None:
        return ms, 0, 0
    d = plan.decode
    n = d.num_seqs
    ms += c["decode_per_row_ms"] * n + c["kv_ns"] * int(d.kv_lens[:n].sum()) * 1e-6
    return ms, 1, n


def decode_steps(policy: Policy, sched: Scheduler) -> int:
    if policy.steps_policy == "fixed":
        return policy.decode_steps
    if policy.steps_policy != "first_finish":
        raise ValueError(f"unknown steps_policy {policy.steps_policy!r}")
    return sched.steps_to_first_finish(policy.decode_steps)


class VisionWorker:
    """The vision thread's launches in simulated time (see COST's vision_* keys)."""

    def __init__(self, c: dict[str, float]) -> None:
        self.launch_ms, self.wait_ms = c["vision_launch_ms"], c["vision_batch_wait_ms"]
        self.batch = int(c["vision_batch"])
        self.queue: list[tuple[float, int]] = []  # (queued at, request id), in order
        self.done: dict[int, float] = {}  # request id -> its call launched (encoding at hand)
        self.free = 0.0
        self.demanded: dict[int, float] = {}  # queued request id -> when the engine asked for it

    def add(self, rid: int, at: float, urgent: bool = False) -> None:
        """Queue `rid`'s image at `at`; `urgent`: its call starts without waiting for a batch."""
        if self.launch_ms > 0:
            self.queue.append((at, rid))
            if urgent:
                self.demanded.setdefault(rid, at)

    def run(self, until: float) -> None:
        """Start every call due by `until`."""
        while self.queue:
            due = self.queue[0][0] + self.wait_ms
            if len(self.queue) >= self.batch:
                due = min(due, self.queue[self.batch - 1][0])
            if self.demanded:
                due = min(due, *self.demanded.values())
            start = max(self.free, due)
            if start > until:
                return
            # the demanded images first, then in queue order
            order = sorted((q for q in self.queue if q[0] <= start), key=lambda q: q[1] not in self.demanded)
            for q in order[: self.batch]:
                self.queue.remove(q)
                self.demanded.pop(q[1], None)
                self.done[q[1]] = start + self.launch_ms
            self.free = start + self.launch_ms

    def _demand(self, rid: int, now: float) -> None:
        if rid not in self.done:
            self.demanded.setdefault(rid, now)

    def ask(self, rid: int, now: float) -> float:
        """The engine needs `rid`'s encoding at `now`: when its call is launched."""
        if self.launch_ms <= 0:
            return now
        self._demand(rid, now)
        while rid not in self.done:
            self.run(float("inf"))
        return self.done[rid]

    def ready(self, rid: int, now: float) -> bool:
        """Whether `rid`'s encoding is at hand at `now` (asking for it, as the engine's check does)."""
        if self.launch_ms <= 0:
            return True
        self._demand(rid, now)
        self.run(now)
        return rid in self.done and self.done[rid] <= now


def simulate(policy: Policy, work: Workload, c: dict[str, float]) -> Result:
    cfg = SchedulerConfig(num_pages=work.pages, page_size=work.page_size, max_seq_len=2048,
                          decode_buckets=policy.decode_buckets, prefill_token_buckets=policy.prefill_token_buckets,
                          prefill_token_budget=policy.prefill_token_budget, max_prefill_seqs=policy.max_prefill_seqs,
                          image_prefix_len=730, enable_prefix_cache=True,
                          mixed_decode_buckets=(max(policy.decode_buckets),))
    now = [0.0]  # host time, ms
    sched = Scheduler(cfg, clock=lambda: now[0])
    rng = np.random.default_rng(work.seed)
    ids = itertools.count()
    arrivals: list[tuple[float, int, int]] = []  # (time, request id, client)
    client_of: dict[int, int] = {}
    arrived: dict[int, float] = {}
    first: dict[int, float] = {}
    left = {cl: work.requests_per_client for cl in range(work.clients)}
    res = Result()

    vision = VisionWorker(c)

    def ask(client: int, at: float) -> None:
        if left[client] == 0:
            return
        left[client] -= 1
        rid = next(ids)
        client_of[rid] = client
        heapq.heappush(arrivals, (at, rid, client))
        if policy.encode_at == "arrival":
            vision.add(rid, at)

    for cl in range(work.clients):
        ask(cl, 0.0)
    device_free = 0.0
    pending: tuple[float, list[int], list[int]] | None = None  # (end, first-token ids, finished ids)

    def read(p: tuple[float, list[int], list[int]]) -> None:
        end, firsts, done = p
        now[0] = max(now[0], end)
        for rid in firsts:
            first[rid] = end
        for rid in done:
            res.requests += 1
            res.output_tokens += work.max_tokens
            res.ttft_ms.append(first[rid] - arrived[rid])
            res.latency_ms.append(end - arrived[rid])
            ask(client_of[rid], end + c["client_ms"])

    if policy.encode_at not in ("drain", "before_wait", "arrival"):
        raise ValueError(f"unknown encode_at {policy.encode_at!r}")

    def drain(urgent: bool) -> None:
        """The engine thread takes the requests that arrived by now from its inbox."""
        while arrivals and arrivals[0][0] <= now[0]:
            at, rid, _ = heapq.heappop(arrivals)
            arrived[rid] = at
            if policy.encode_at != "arrival":
                vision.add(rid, now[0], urgent=urgent)
            sched.add(Request(request_id=rid, prompt_len=work.prompt, max_new_tokens=work.max_tokens,
                              image_digest=rng.bytes(32), prefix_len=730,
                              prompt_tokens=tuple(int(x) for x in rng.integers(1, 50_000, work.prompt))))

    while arrivals or sched.has_work() or pending is not None:
        drain(urgent=policy.encode_at == "before_wait")
        now[0] += c["schedule_ms"]
        ready = (lambda r: vision.ready(int(r), now[0])) if policy.defer else None
        plan = sched.schedule(decode_steps(policy, sched), ready=ready)
        if plan is None:
            if pending is not None:
                read(pending)
                pending = None
            elif arrivals:
                now[0] = max(now[0], arrivals[0][0])
            continue
        kind = "decode" if isinstance(plan, DecodePlan) else ("mixed" if plan.decode is not None else "prefill")
        if isinstance(plan, PrefillPlan):
            for b in range(plan.num_seqs):
                if plan.prefix_lens[b] > 0 and plan.context_lens[b] == 0:
                    at = vision.ask(int(plan.seq_ids[b]), now[0])  # type: ignore[call-overload]
                    res.image_wait_s += max(0.0, at - now[0]) * 1e-3
                    now[0] = max(now[0], at)
        now[0] += c[f"launch_{kind}_ms"]
        ms, iters, rows = plan_cost(c, plan)
        ms *= c["device_scale"]
        start = max(now[0], device_free)
        device_free = start + ms
        res.device_busy_s += ms * 1e-3
        res.steps[kind] += 1
        res.decode_iterations += iters
        res.decode_rows += rows
        firsts: list[int] = []
        if isinstance(plan, PrefillPlan):
            firsts = [int(plan.seq_ids[b]) for b in range(plan.num_seqs)  # type: ignore[call-overload]
                      if plan.logits_rows[b] >= 0]
        sched.commit(plan)
        done = [int(f.request_id) for f in sched.take_finished()]  # type: ignore[call-overload]
        if policy.encode_at == "before_wait" and pending is not None:
            drain(urgent=True)  # between the launch and the wait below
        if pending is not None:
            read(pending)
        pending = (device_free, firsts, done)
    res.wall_s = now[0] * 1e-3
    return res


def parse_grid(items: list[str]) -> list[dict[str, Any]]:
    axes: list[list[tuple[str, Any]]] = []
    for item in items:
        key, _, raw = item.partition("=")
        values: list[Any] = []
        for v in raw.split(":"):
            if key in ("prefill_token_buckets", "decode_buckets"):
                values.append(tuple(int(x) for x in v.split(",")))
            elif key in ("steps_policy", "encode_at"):
                values.append(v)
            else:
                values.append(int(v))
        axes.append([(key, v) for v in values])
    return [dict(combo) for combo in itertools.product(*axes)] if axes else [{}]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", nargs="*", default=[],
                    help="Policy fields, values separated by ':' (a bucket list by ','), e.g. decode_steps=4:8")
    ap.add_argument("--cost", nargs="*", default=[], help="cost model overrides KEY=VALUE (ms unless named)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128, help="answer tokens of every request (forced)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    c = dict(COST)
    for item in a.cost:
        key, _, raw = item.partition("=")
        if key not in c:
            raise SystemExit(f"--cost: unknown key {key!r}; keys: {sorted(c)}")
        c[key] = float(raw)
    work = Workload(clients=a.clients, requests_per_client=a.requests_per_client, max_tokens=a.max_tokens)
    out = []
    for overrides in parse_grid(a.grid):
        pol = Policy(**overrides)
        s = simulate(pol, work, c).summary()
        out.append({"policy": pol.label(), **s})
        print(f"{pol.label():40s} {s['output_tok_s']:8.1f} tok/s  TTFT p50 {s['ttft_ms_p50']:6.1f} "
              f"p90 {s['ttft_ms_p90']:6.1f} ms  busy {s['device_busy']:.3f}  steps {s['steps']}  "
              f"iters {s['decode_iterations']}  batch {s['mean_decode_batch']}  image_wait {s['image_wait_s']}",
              flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"cost": c, "runs": out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
