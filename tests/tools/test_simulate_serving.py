"""tools/simulate_serving.py: the real scheduler in simulated time under a cost model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
