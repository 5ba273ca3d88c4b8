"""tools/bench_scheduler.py: a small drive reaches the evicting regime and reports its timing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_small_drive_fills_the_cache_and_times_schedule(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    cmd = [sys.executable, str(REPO / "tools" / "bench_scheduler.py"), "--clients", "8", "--pages", "400",
           "--warmup", "60", "--steps", "120", "--max-tokens", "16", "--profile", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert r["schedule_ms_per_step"] > 0 and r["finished"] > 8  # clients came back for more
    # the pool fills with cached images, so admissions evict
    assert r["cached_entries"] >= 10 and r["evicted_pages"] > 0
    assert "reclaim" in r["profile"] or "schedule" in r["profile"]
