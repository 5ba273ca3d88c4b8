"""Two step probes compared: totals, launches and the families that changed, largest first."""

from __future__ import annotations

from tools.diff_step_kernels import diff


def _probe(families: list[tuple[str, float, int]], switches: dict[str, str]) -> dict:
    return {"model": "md3", "switches": switches, "steps": {"decode": {
        "total_us": sum(us for _, us, _ in families), "launches": sum(n for _, _, n in families),
        "families": [{"family": f, "us": us, "launches": n} for f, us, n in families]}}}


def test_changed_families_are_listed_largest_first():
    a = _probe([("body_mosaic_gpu_kernel", 3000.0, 40), ("loop_transpose_fusion", 29.4, 20),
                ("wrapped_transpose", 27.6, 20), ("loop_add_fusion", 130.3, 44)], {})
    b = _probe([("body_mosaic_gpu_kernel", 3000.0, 40), ("loop_add_fusion", 140.0, 44)],
               {"KESTREL_JAX_TAU_GELU": "1"})
    lines = diff(a, b, top=10)
    assert "KESTREL_JAX_TAU_GELU" in lines[1]
    assert lines[2].startswith("decode: 3187.3 -> 3140.0 us (-47.3, -1.5%), launches 124 -> 84 (-40)")
    changed = [ln.split()[-1] for ln in lines[3:]]
    assert changed == ["loop_transpose_fusion", "wrapped_transpose", "loop_add_fusion"]  # unchanged: not listed


def test_wall_clock_is_compared_where_both_probes_have_it():
    a = _probe([("k", 100.0, 1)], {})
    b = _probe([("k", 90.0, 1)], {})
    assert not any("wall" in ln for ln in diff(a, b, top=5))  # older probes: no wall clock
    a["steps"]["decode"]["wall_us"], b["steps"]["decode"]["wall_us"] = 1500.0, 1470.0
    assert "decode wall: 1500.0 -> 1470.0 us (-30.0, -2.0%)" in diff(a, b, top=5)
