"""tools/simulate_serving.py: the real scheduler in simulated time under a cost model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import simulate_serving as sim  # noqa: E402


def test_closed_loop_accounting_and_device_bound() -> None:
    work = sim.Workload(clients=8, requests_per_client=3, max_tokens=24)
    res = sim.simulate(sim.Policy(decode_buckets=(1, 8)), work, dict(sim.COST))
    s = res.summary()
    assert res.requests == 24 and res.output_tokens == 24 * 24 and len(res.ttft_ms) == 24
    assert all(0 < t <= lat for t, lat in zip(res.ttft_ms, res.latency_ms, strict=True))
    # every generated token is a decode row except each request's first (sampled by its prefill)
    assert res.decode_rows == 24 * 23
    assert 0.5 < s["device_busy"] <= 1.0 and s["steps"]["prefill"] + s["steps"]["mixed"] >= 12


def test_slower_device_is_slower_and_costs_add_up() -> None:
    work = sim.Workload(clients=4, requests_per_client=2, max_tokens=16)
    pol = sim.Policy(decode_buckets=(1, 4))
    fast = sim.simulate(pol, work, dict(sim.COST))
    slow = sim.simulate(pol, work, {**sim.COST, "device_scale": 2.0})
    assert slow.wall_s > 1.5 * fast.wall_s
    assert abs(slow.device_busy_s - 2 * fast.device_busy_s) < 1e-9
    c = dict(sim.COST)
    assert sim.decode_ms(c, 64, 0) > sim.decode_ms(c, 1, 0) > 0
    assert sim.prefill_ms(c, 1536, 1480, 2) > sim.prefill_ms(c, 768, 740, 1)


def test_stopping_launches_at_the_first_finish_keeps_the_batch_fuller() -> None:
    """A closed loop of fixed-length answers (the W2 shape): capped launches admit each client's
    next request sooner, so the decode batch runs fuller and TTFT drops."""
    work = sim.Workload(clients=16, requests_per_client=4, max_tokens=48)
    c = dict(sim.COST)
    fixed = sim.simulate(sim.Policy(decode_buckets=(1, 16)), work, c).summary()
    capped = sim.simulate(sim.Policy(decode_buckets=(1, 16), steps_policy="first_finish"), work, c).summary()
    assert capped["mean_decode_batch"] > fixed["mean_decode_batch"]
    assert capped["ttft_ms_p50"] < fixed["ttft_ms_p50"]


def test_cli_grid(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    cmd = [sys.executable, str(REPO / "tools" / "simulate_serving.py"), "--clients", "4", "--requests-per-client",
           "2", "--grid", "decode_steps=1:8", "prefill_token_buckets=768,1536", "--cost", "vision_ms=2.5",
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert r["cost"]["vision_ms"] == 2.5 and [x["policy"] for x in r["runs"]] == [
        "K=1 buckets=768,1536", "K=8 buckets=768,1536"]
    assert all(x["output_tok_s"] > 0 for x in r["runs"])
    bad = subprocess.run([*cmd[:2], "--cost", "nope=1"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert bad.returncode != 0 and "unknown key" in bad.stderr


def test_vision_worker_batches_waits_and_serves_demands() -> None:
    c = {**sim.COST, "vision_launch_ms": 5.0, "vision_batch": 2, "vision_batch_wait_ms": 30.0}
    w = sim.VisionWorker(c)
    w.add(1, 0.0)
    w.run(29.0)
    assert 1 not in w.done  # waiting for a second image or the 30 ms
    w.run(30.0)
    assert w.done[1] == 35.0 and w.free == 35.0
    w.add(2, 40.0)
    w.add(3, 41.0)  # a full batch of two: one call at once
    w.run(41.0)
    assert w.done[2] == w.done[3] == 46.0
    w.add(4, 50.0)
    assert not w.ready(4, 52.0)  # asked for: its call starts now, launched 5 ms later
    assert w.done[4] == 57.0 and w.ready(4, 57.0)
    w.add(5, 60.0)
    assert w.ask(5, 61.0) == 66.0  # the engine waits for the launch
    assert sim.VisionWorker(sim.COST).ask(9, 3.0) == 3.0  # no worker model: never waits


def test_image_waits_appear_with_the_worker_model() -> None:
    work = sim.Workload(clients=8, requests_per_client=2, max_tokens=24)
    pol = sim.Policy(decode_buckets=(1, 8), steps_policy="first_finish")
    plain = sim.simulate(pol, work, dict(sim.COST))
    slow = sim.simulate(pol, work, {**sim.COST, "vision_launch_ms": 20.0})
    assert plain.image_wait_s == 0 and slow.image_wait_s > 0
    deferred = sim.simulate(sim.Policy(decode_buckets=(1, 8), steps_policy="first_finish", defer=1), work,
                            {**sim.COST, "vision_launch_ms": 20.0})
    assert deferred.image_wait_s < slow.image_wait_s and deferred.requests == 16


def test_admitting_before_the_wait_starts_encodings_earlier() -> None:
    """encode_at="before_wait" (EngineConfig.admit_before_wait): requests that arrived by the end of
    a launch are taken before the wait for the previous step and their images queued as urgent, so
    the engine waits less for encoding launches; an urgent image's call does not wait for a batch;
    an unknown mode is refused."""
    w = sim.VisionWorker({**sim.COST, "vision_launch_ms": 5.0, "vision_batch_wait_ms": 30.0})
    w.add(1, 10.0, urgent=True)
    w.run(11.0)
    assert w.done[1] == 15.0  # started at once, not 30 ms later
    work = sim.Workload(clients=8, requests_per_client=2, max_tokens=24)
    cost = {**sim.COST, "vision_launch_ms": 3.0}
    drain = sim.simulate(sim.Policy(decode_buckets=(1, 8), steps_policy="first_finish"), work, cost)
    early = sim.simulate(sim.Policy(decode_buckets=(1, 8), steps_policy="first_finish", encode_at="before_wait"),
                         work, cost)
    assert early.requests == drain.requests == 16
    assert early.image_wait_s < drain.image_wait_s
    with pytest.raises(ValueError, match="encode_at"):
        sim.simulate(sim.Policy(encode_at="later"), work, cost)
