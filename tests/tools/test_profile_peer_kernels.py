"""tools/profile_peer_kernels.py: the per-kernel table, and a CLI that starts without the peer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tools.profile_peer_kernels import kernel_table  # noqa: E402


def test_kernel_table_counts_sums_and_takes_the_median() -> None:
    # a decode kernel launched 5 times (one slow outlier: the prefill's launch) and a one-off
    events = [("attn", 8.0), ("attn", 8.2), ("attn", 40.0), ("attn", 8.1), ("attn", 7.9), ("lm_head", 52.0)]
    table = kernel_table(events)
    assert [r["kernel"] for r in table] == ["attn", "lm_head"]  # by total time
    attn = table[0]
    assert attn["launches"] == 5 and attn["total_us"] == 72.2
    assert attn["median_us"] == 8.1  # the decode launches' time, not the outlier's
    assert attn["mean_us"] == 14.44
    assert table[1] == {"kernel": "lm_head", "launches": 1, "total_us": 52.0, "mean_us": 52.0, "median_us": 52.0}
    assert kernel_table([]) == []


def test_help_needs_neither_torch_nor_kestrel() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "profile_peer_kernels.py"), "--help"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "--bursts" in proc.stdout and "torch.profiler" in proc.stdout
