"""The step probe's HLO index (CUPTI kernel names mapped to their fusion's output shape and op),
its run aggregation, and its in-process A/B (--ab): the switch spec and the interleaved order."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tools.probe_step_kernels import (
    aggregate_runs,
    apply_variant,
    family,
    hlo_index,
    interleaved,
    parse_ab,
    parse_sets,
    variant_sets,
    wall_times,
)

# one line per instruction, as XLA prints them
HLO = """
%fused_add.18 (param_0: bf16[8,4]) -> bf16[8,4] {
  ROOT %add.1 = bf16[8,4]{1,0} add(%param_0, %param_0)
}

ENTRY %main.1 (p: bf16[8,4]) -> bf16[8,4] {
  %p = bf16[8,4]{1,0} parameter(0)
  %loop_add_fusion.18 = bf16[8,4]{1,0} fusion(%p), kind=kLoop, calls=%fused_add.18, \
metadata={op_name="jit(_prefill_step)/jit(moe_layer)/add" scheduling_name="loop_add_fusion.18"}
  %custom-call.3 = (f8e4m3fn[16,4]{1,0}, s8[64]{0}) custom-call(%loop_add_fusion.18), custom_call_target="mosaic_gpu"
  ROOT %gemm_fusion_dot = bf16[8,4]{1,0} fusion(%loop_add_fusion.18), kind=kCustom, calls=%fused_add.18
}
"""


def test_kernel_names_map_to_shapes_and_ops():
    ix = hlo_index(HLO)
    assert ix["loop_add_fusion_18"] == "bf16[8,4]{1,0}  jit(moe_layer)/add"
    assert ix["gemm_fusion_dot"].startswith("bf16[8,4]{1,0}")
    assert ix["custom-call_3"].startswith("(f8e4m3fn[16,4]{1,0}, s8[64]{0})")
    assert "p" not in ix and "add_1" not in ix  # parameters and fused instructions are not kernels
    assert family("loop_add_fusion_18") == "loop_add_fusion" and family("sort_1_1") == "sort_1"


def test_aggregate_runs_takes_medians_and_tolerates_a_kernel_missing_from_a_run():
    runs = [[("gemm", 0.010), ("add", 0.001), ("gemm", 0.010)],
            [("gemm", 0.012), ("add", 0.002), ("gemm", 0.012), ("copy", 0.005)],
            [("gemm", 0.011), ("add", 0.003), ("gemm", 0.011)]]
    rows = {r["kernel"]: r for r in aggregate_runs(runs)}
    assert list(rows) == ["gemm", "add", "copy"]
    assert rows["gemm"] == {"kernel": "gemm", "us": 22.0, "launches": 2}
    assert rows["add"]["us"] == 2.0 and rows["add"]["launches"] == 1
    assert rows["copy"] == {"kernel": "copy", "us": 0.0, "launches": 1}  # median of 0, 5, 0


def test_ab_spec_names_a_switch_and_at_least_two_values():
    assert parse_ab(None) is None
    assert parse_ab("KESTREL_JAX_TAU_DOTS=0,1") == ("KESTREL_JAX_TAU_DOTS", ["0", "1"])
    assert parse_ab("KESTREL_JAX_DECODE_SPLITS=0, 2,4") == ("KESTREL_JAX_DECODE_SPLITS", ["0", "2", "4"])
    for bad in ("KESTREL_JAX_TAU_DOTS=1", "TAU_DOTS=0,1", "KESTREL_JAX_TAU_DOTS"):
        with pytest.raises(SystemExit, match="--ab"):
            parse_ab(bad)


def test_sets_name_variants_of_several_switches_and_restore_the_rest(monkeypatch):
    sets = parse_sets(["default", "KESTREL_JAX_A=1", "KESTREL_JAX_A=0+KESTREL_JAX_B=2"])
    assert sets == [("default", {}), ("KESTREL_JAX_A=1", {"KESTREL_JAX_A": "1"}),
                    ("KESTREL_JAX_A=0+KESTREL_JAX_B=2", {"KESTREL_JAX_A": "0", "KESTREL_JAX_B": "2"})]
    assert parse_sets(None) is None
    for bad in (["default"], ["default", "default"], ["default", "A=1"], ["default", "KESTREL_JAX_A="]):
        with pytest.raises(SystemExit, match="--sets"):
            parse_sets(bad)
    assert variant_sets(("KESTREL_JAX_T", ["0", "1"]), None) == [("KESTREL_JAX_T=0", {"KESTREL_JAX_T": "0"}),
                                                                  ("KESTREL_JAX_T=1", {"KESTREL_JAX_T": "1"})]
    with pytest.raises(SystemExit, match="--ab and --sets"):
        variant_sets(("KESTREL_JAX_T", ["0", "1"]), sets)
    monkeypatch.setenv("KESTREL_JAX_A", "5")
    monkeypatch.delenv("KESTREL_JAX_B", raising=False)
    names, saved = {"KESTREL_JAX_A", "KESTREL_JAX_B"}, {"KESTREL_JAX_A": "5", "KESTREL_JAX_B": None}
    assert sets is not None
    apply_variant(sets[2][1], names, saved)
    assert (os.environ["KESTREL_JAX_A"], os.environ["KESTREL_JAX_B"]) == ("0", "2")
    apply_variant(sets[0][1], names, saved)  # default: the environment as it was
    assert os.environ["KESTREL_JAX_A"] == "5" and "KESTREL_JAX_B" not in os.environ


def test_variants_are_measured_in_turn():
    calls: list[str] = []

    def measure(fn, args, iters):
        assert iters == 1 and args == (7,)
        calls.append(fn)
        return [[(f"k_{fn}", 0.001 * len(calls))]], "fake"

    runs, how = interleaved(["a", "b"], (7,), 3, measure=measure)
    assert calls == ["a", "b", "a", "b", "a", "b"] and how == "fake"
    assert [len(r) for r in runs] == [3, 3]
    assert [r[0][0] for r in runs[0]] == ["k_a"] * 3 and [ms for r in runs[1] for _, ms in r] == [0.002, 0.004, 0.006]


def test_wall_clock_is_taken_in_turn_after_a_warm_call():
    calls: list[str] = []

    def variant(name):
        def f(x):
            calls.append(name)
            return x
        return f

    walls = wall_times([variant("a"), variant("b")], (np.zeros(2),), 3)
    assert calls == ["a", "b"] + ["a", "b"] * 3  # one warm call each, then in turn
    assert len(walls) == 2 and all(0.0 <= launch <= wall for wall, launch in walls)


def test_launch_time_is_until_the_call_returns():
    """A call that returns at once and whose outputs take 30 ms: launch ~0, wall >= 30 ms."""
    import time as _time

    class Slow:
        def block_until_ready(self):
            _time.sleep(0.03)
            return self

    (wall, launch), = wall_times([lambda x: Slow()], (0,), 2)
    assert wall >= 30e3 and launch < 10e3


def test_host_lines_per_call_busiest_first():
    from types import SimpleNamespace as NS

    from tools.probe_step_kernels import summarize_host_lines

    def ev(name, us):
        return NS(name=name, duration_ns=int(us * 1000))

    busy = NS(name="launcher", events=[ev("Execute", 300), ev("Launch", 10), ev("Launch", 20), ev("Execute", 300)])
    quiet = NS(name="idle", events=[ev("Wait", 1)])
    data = NS(planes=[NS(name="/device:GPU:0", lines=[NS(name="stream", events=[ev("k", 5)] * 9)]),
                      NS(name="/host:CPU", lines=[quiet, busy])])
    r = summarize_host_lines(data, calls=2)
    assert [ln["line"] for ln in r["lines"]] == ["launcher", "idle"]  # device planes are not host threads
    assert r["lines"][0]["events_per_call"] == 2.0
    assert r["lines"][0]["top"] == [{"name": "Execute", "per_call": 1.0, "us_per_call": 300.0},
                                    {"name": "Launch", "per_call": 1.0, "us_per_call": 15.0}]


def test_putting_hands_the_call_device_arrays():
    import jax

    from tools.probe_step_kernels import putting

    got: list[object] = []

    def step(*xs):
        got.extend(xs)
        return 7

    call = putting(step, jax.devices()[0])
    host, dev = np.arange(3), jax.numpy.ones(2)
    assert call(host, dev, 5) == 7
    assert isinstance(got[0], jax.Array) and np.array_equal(np.asarray(got[0]), host)
    assert got[1] is dev and got[2] == 5
