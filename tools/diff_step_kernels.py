#!/usr/bin/env python3
"""Two step probes side by side (tools/probe_step_kernels.py --json): per step, the device time and
launches of each, then the kernel families whose time changed most, so an A/B of a switch reads
as "which kernels went away, which came, what it cost".

  python3 tools/diff_step_kernels.py base.json switched.json [--top 15]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def family_times(step: dict[str, Any]) -> dict[str, tuple[float, int]]:
    return {f["family"]: (float(f["us"]), int(f["launches"])) for f in step["families"]}


def diff(a: dict[str, Any], b: dict[str, Any], top: int) -> list[str]:
    lines = [f"A: {a.get('model')} {a.get('switches', {})}", f"B: {b.get('model')} {b.get('switches', {})}"]
    for kind in [k for k in a["steps"] if k in b["steps"]]:
        sa, sb = a["steps"][kind], b["steps"][kind]
        ta, tb = float(sa["total_us"]), float(sb["total_us"])
        lines.append(f"{kind}: {ta:.1f} -> {tb:.1f} us ({tb - ta:+.1f}, {100 * (tb - ta) / ta:+.1f}%), "
                     f"launches {sa['launches']} -> {sb['launches']} ({sb['launches'] - sa['launches']:+d})")
        if "wall_us" in sa and "wall_us" in sb:
            wa, wb = float(sa["wall_us"]), float(sb["wall_us"])
            lines.append(f"{kind} wall: {wa:.1f} -> {wb:.1f} us ({wb - wa:+.1f}, {100 * (wb - wa) / wa:+.1f}%)")
        fa, fb = family_times(sa), family_times(sb)
        rows = []
        for fam in set(fa) | set(fb):
            (ua, la), (ub, lb) = fa.get(fam, (0.0, 0)), fb.get(fam, (0.0, 0))
            rows.append((ub - ua, fam, ua, la, ub, lb))
        rows.sort(key=lambda r: -abs(r[0]))
        for d, fam, ua, la, ub, lb in rows[:top]:
            if d == 0 and la == lb:
                break
            lines.append(f"   {d:+9.1f} us  {ua:9.1f} x{la:<4d} -> {ub:9.1f} x{lb:<4d} {fam[:90]}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args(argv)
    a, b = (json.loads(Path(p).read_text()) for p in (args.a, args.b))
    print("\n".join(diff(a, b, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
