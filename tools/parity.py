#!/usr/bin/env python3
"""Golden parity check: `python tools/parity.py GOLDEN_ROOT` (e.g. ../shared/golden).

Loads every model folder under GOLDEN_ROOT through the normal checkpoint loader, runs each stage
the golden README describes in float32, prints per-stage errors relative to the golden tensor's
max and every discrete decision, and exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, installed or not

from kestrel_jax.parity import DEFAULT_REL_TOL, run_parity  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("golden_root", type=Path)
    ap.add_argument("--rel-tol", type=float, default=DEFAULT_REL_TOL)
    args = ap.parse_args(argv)
    jax.config.update("jax_default_matmul_precision", "highest")
    t0 = time.perf_counter()
    reports = run_parity(args.golden_root, rel_tol=args.rel_tol, log=lambda s: print(f"[parity] {s}", flush=True))
    for r in reports:
        print("\n".join(r.lines()))
    ok = all(r.ok for r in reports)
    print(f"parity {'PASSED' if ok else 'FAILED'} for {len(reports)} model(s) in {time.perf_counter() - t0:.1f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
