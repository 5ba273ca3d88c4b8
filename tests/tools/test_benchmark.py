"""tools/benchmark.py: a quick end-to-end run on a tiny synthetic MD3 (CPU, real engine) that must
produce every workload's figures, plus the pieces that need no engine (byte accounting at full
MD3 size, engine-argument parsing, the ours/Kestrel ratio table, the warm-start-up merge)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import jax.numpy as jnp
import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "benchmark.py"
# Small enough for a CPU: one decode bucket, one prefill bucket that holds the 740-token prompt,
# 2-crop images only, f32 (XLA:CPU compiles it faster than bf16).
ENGINE_ARGS = ["dtype=float32", "runner.kv_dtype=f32", "decode_buckets=2", "prefill_token_buckets=768",
               "max_prefill_seqs=2", "runner.vision_buckets=2", "runner.num_pages=64", "runner.max_seq_len=832"]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kjx_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, Path]:
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "r.json"
    cmd = [sys.executable, str(SCRIPT), "--model", "tiny-md3", "--quick", "--out", str(out),
           "--trace-dir", str(tmp / "trace"), "--w4-images", "378x378", "--w1-tokens", "16", "--host-profile",
           "--engine-args", *ENGINE_ARGS]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout, tmp


def test_quick_run_reports_every_workload(quick_run: tuple[dict[str, Any], str, Path]) -> None:
    res, stdout, tmp = quick_run
    assert res["errors"] == {} and res["skipped"] == {}
    assert res["checkpoint"]["write_s"] > 0 and res["checkpoint"]["fp8_experts"] and res["checkpoint"]["kv_scales"]
    assert res["device"]["platform"] == "cpu" and res["versions"]["jax"]
    assert res["copy_bandwidth"]["ceiling_gbs"] > 0
    assert res["engine_config"]["decode_buckets"] == [2]
    assert res["startup"][0]["create_s"] > 0 and res["startup"][0]["cache_state"] == "none"
    # JAX's compile-pipeline timings during start-up: every step was traced and compiled
    phases = res["startup"][0]["phases_s"]
    assert phases["jaxpr_trace_duration"][0] > 0 and phases["backend_compile_duration"][1] > 0
    assert res["startup"][0]["variants_s"]["prefill_t768"] > 0
    assert set(res["startup"][0]["export_steps"]) == {"loaded", "exported", "fallback"}

    w1 = res["w1"]["summary"]
    assert w1["n"] == 1 and w1["output_tokens_min"] == 16 and w1["not_full_length"] == 0
    assert w1["decode_tok_s_per_seq_p50"] > 0 and w1["ms_per_token"] > 0
    # the engine thread over the measured requests: its loop phases and a sample of its stack
    assert w1["wall_s"] > 0 and 0 < w1["engine_host_s"]["dispatch"] < w1["wall_s"]
    # inside the dispatch phase: the step calls until they return, image waits, page copies
    host = w1["engine_host_s"]
    inside = ("launch_decode", "launch_prefill", "launch_mixed", "image_wait", "copy_pages")
    assert host["launch_decode"] > 0 and host["launch_prefill"] + host["launch_mixed"] > 0
    assert sum(host[k] for k in inside) <= host["dispatch"] + 1e-3
    assert w1["host_profile"]["samples"] > 0
    # and of the vision thread (its samples: the thread exists, idle or encoding)
    assert w1["vision_thread_profile"]["samples"] > 0
    assert w1["bytes_per_step"]["experts_active"] > 0 and w1["achieved_gbs"] > 0 and w1["fraction_of_copy_bw"] > 0
    for tr in (res["w1"]["trace"], res["w2"]["trace"]):
        assert "error" not in tr, tr
        assert tr["events"] > 0 and Path(tr["file"]).is_file() and str(tmp) in tr["file"]
        assert isinstance(tr["idle_gaps"]["long_by_module"], list)  # the gaps' modules are known
    tr = res["w1"]["trace"]
    assert tr["engine_steps"]["decode"] == 0 or tr["kernels_per_decode_step"] > 0
    mf = res["w2"]["trace"]["module_families"]  # per module: its kernel families, summing to its time
    assert set(mf) == set(res["w2"]["trace"]["modules"])
    for mod, fams in mf.items():
        total = res["w2"]["trace"]["modules"][mod]["time_us"]
        assert fams and sum(f["time_us"] for f in fams) <= total * 1.001 + 0.2

    w2 = res["w2"]["2"]["summary"]
    assert w2["n"] == 2 and w2["requests_per_s"] > 0 and w2["output_tok_s"] > 0
    assert w2["ttft_ms_p50"] > 0 and w2["ttft_ms_p90"] >= w2["ttft_ms_p50"]
    assert w2["cached_tokens_max"] == 0 and w2["not_full_length"] == 0 and w2["input_tokens"] == [740]
    # host ms per launch by step kind: the launch seconds over the scheduler's step counts
    per = w2["launch_ms_per_step"]
    assert per and all(v > 0 for v in per.values())
    kind = next(iter(per))
    want = w2["engine_host_s"][f"launch_{kind}"] / w2["scheduler"][f"{kind}_steps"] * 1e3
    assert abs(per[kind] - want) <= 1e-3 + 1e-3 * want
    # EngineConfig.admit_before_wait is on by default: a count of this run's requests (timing decides it)
    assert isinstance(w2["admitted_before_wait"], int) and 0 <= w2["admitted_before_wait"] <= w2["n"]
    assert res["device"]["xla_defaults"]["xla_gpu_command_buffer_update_mode"] in ("added", "user", "off")
    for c in ("1", "2"):
        w3 = res["w3"][c]["summary"]
        assert w3["n"] == 2 and w3["requests_per_s"] > 0 and w3["cached_tokens_max"] == 0
        assert w3["latency_ms_p99"] >= w3["latency_ms_p50"] > 0
    w4 = res["w4"]["378x378"]
    assert w4["crops"] == 2 and w4["cold"]["ttft_ms_p50"] > 0 and w4["cold"]["cached_tokens_max"] == 0
    assert w4["warm"]["cached_tokens_min"] >= 730 and w4["warm"]["ttft_ms_p50"] > 0
    assert res["headline"]["decode_tok_s_b1"] == w1["decode_tok_s_per_seq_p50"]
    assert res["headline"]["ttft_ms_378"] == w4["cold"]["ttft_ms_p50"]
    assert "| w2 | C=2 req/s" in stdout and "| w4 | TTFT 378x378 (2 crops)" in stdout


@pytest.mark.parametrize("name", ["r.json", "r.json.gz"])
def test_append_adds_a_startup_record_and_keeps_the_rest(bench: ModuleType, tmp_path: Path, name: str) -> None:
    out = tmp_path / name
    bench.write_json(out, {"model": "md3", "w1": {"summary": {"x": 1}}, "startup": [{"create_s": 9.0}],
                           "errors": {}})
    assert (out.read_bytes()[:2] == b"\x1f\x8b") == name.endswith(".gz")  # gzip magic
    a = bench.parse_args(["--model", "md3", "--out", str(out), "--append"])
    o = bench.Output(a)
    o.res["startup"] = [{"create_s": 2.0, "cache_state": "warm"}]
    o.res["errors"]["startup"] = "boom"
    o.dump()
    got = bench.read_json(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no temporary file left
    assert [s["create_s"] for s in got["startup"]] == [9.0, 2.0]
    assert got["w1"] == {"summary": {"x": 1}} and got["errors"] == {"append:startup": "boom"}


def test_compile_cache_is_counted_when_the_arguments_are_read(bench: ModuleType, tmp_path: Path) -> None:
    """The cache's entries are counted by parse_args, before the process compiles anything (the
    random weights' programs land in the cache too and made a fresh cache look warm)."""
    cache = tmp_path / "cc"
    assert bench.parse_args(["--model", "md3", "--compile-cache", str(cache)]).cache_entries == 0  # none yet
    (cache / "sub").mkdir(parents=True)
    (cache / "a").write_bytes(b"x")
    (cache / "sub" / "b").write_bytes(b"y")
    assert bench.parse_args(["--model", "md3", "--compile-cache", str(cache)]).cache_entries == 2
    assert bench.parse_args(["--model", "md3"]).cache_entries == 0


def test_decode_bytes_full_size_md3(bench: ModuleType) -> None:
    from kestrel_jax.models.config import md2_config, md3_config
    from kestrel_jax.models.moondream import abstract_model

    md3 = abstract_model(md3_config(), dtype=jnp.bfloat16, fp8_experts=True)
    b1 = bench.decode_bytes(md3, batch=1, context=1000, kv_dtype="float8_e4m3fn")
    # KERNELS.md section 2: ~1.28 GB of bf16 non-expert text weights + ~1.0 GB of FP8 active experts
    assert 1.2e9 < b1["weights_dense"] < 1.35e9
    assert 0.98e9 < b1["experts_active"] < 1.03e9
    assert b1["kv"] == 24 * 2 * 32 * 64 * 1 * 1000
    b64 = bench.decode_bytes(md3, batch=64, context=1000, kv_dtype="float8_e4m3fn")
    assert 7.9e9 < b64["experts_active"] < 8.1e9  # nearly every expert is touched at batch 64
    md2 = bench.decode_bytes(abstract_model(md2_config(), dtype=jnp.bfloat16), batch=1, context=10,
                             kv_dtype="bfloat16")
    assert md2["experts_active"] == 0 and 2.5e9 < md2["weights_dense"] < 3.0e9


def test_engine_args(bench: ModuleType) -> None:
    cfg = bench.engine_config("/x", ["decode_buckets=1,4", "prefill_token_buckets=768", "runner.num_pages=12",
                                     "runner.kv_dtype=fp8", "warmup=False"], "/cache")
    assert cfg.decode_buckets == (1, 4) and cfg.prefill_token_buckets == (768,) and cfg.warmup is False
    assert cfg.runner.num_pages == 12 and cfg.runner.kv_dtype == "fp8" and cfg.runner.compilation_cache_dir == "/cache"
    for bad in (["nope=1"], ["decode_buckets"], ["runner=1"], ["runner.nope=2"]):
        with pytest.raises(SystemExit):
            bench.engine_config("/x", bad, None)


def test_ratio_table_against_kestrel_summaries(bench: ModuleType) -> None:
    ours = {"md3": {"w1": {"summary": {"decode_tok_s_per_seq_p50": 848.0}},
                    "w4": {"378x378": {"cold": {"ttft_ms_p50": 90.0}}},
                    "w2": {"64": {"summary": {"requests_per_s": 17.0, "output_tok_s": 2177.5, "ttft_ms_p50": 500.0}}}}}
    # both shapes bench_kestrel.py writes: full ({"summary": ...}) and the compact stored one
    full = {"model": "moondream3-preview", "single": {"378": {"summary": {"decode_tok_s_per_seq_p50": 424.0,
                                                                         "ttft_ms_p50": 45.0}}},
            "concurrency": {"64": {"summary": {"requests_per_s": 34.0, "output_tok_s": 4355.0}}}}
    compact = {"single": {"378": {"decode_tok_s_per_seq_p50": 424.0, "ttft_ms_p50": 45.0}},
               "concurrency": {"64": {"requests_per_s": 34.0, "output_tok_s": 4355.0}}}
    for peer in (full, compact):
        text, table = bench.ratio_table(ours, {"md3": peer}, "same run")
        t = table["md3"]
        assert t["decode_tok_s_b1"]["ratio"] == 2.0 and t["ttft_ms_378"]["ratio"] == 2.0
        assert t["req_s_c64"]["ratio"] == 0.5 and t["out_tok_s_c64"]["ratio"] == 0.5
        assert t["ttft_ms_756"]["ratio"] is None
        assert "| md3 | batch-1 decode tok/s | 848.0 | 424.0 | 2.0 | ours |" in text
        assert "| md3 | TTFT 378 px ms | 90.0 | 45.0 | 2.0 | Kestrel |" in text  # lower is better


def test_compare_cli_falls_back_to_the_stored_reference(bench: ModuleType, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    ours = {"model": "md2", "w1": {"summary": {"decode_tok_s_per_seq_p50": 600}}}
    bench.write_json(tmp_path / "md2.json.gz", ours)  # result files may be kept gzipped
    ref = {"runs": {"run2": {"md2": {"single": {"378": {"decode_tok_s_per_seq_p50": 500.0}}}}}}
    (tmp_path / "ref.json").write_text(json.dumps(ref))
    rc = bench.main(["compare", "--ours", str(tmp_path / "md2.json.gz"), "--peer", str(tmp_path / "missing.json"),
                     "--ref", str(tmp_path / "ref.json"), "--out", str(tmp_path / "ratios.json")])
    assert rc == 0
    got = json.loads((tmp_path / "ratios.json").read_text())
    assert got["reference"]["md2"]["decode_tok_s_b1"]["ratio"] == 1.2
    assert "against the stored reference" in capsys.readouterr().out


def test_idle_gaps_by_length_and_neighbours(bench: ModuleType) -> None:
    us = 1000  # spans are in ns
    spans = [(0, 5 * us), (6 * us, 10 * us), (8 * us, 12 * us),  # a 1 us gap, then an overlap
             (112 * us, 120 * us), (1620 * us, 1630 * us)]       # 100 us, then 1,500 us idle
    names = {spans[0]: "fusion_1", spans[1]: "fusion_2", spans[2]: "gemm_3", spans[3]: "attn_4",
             spans[4]: "fusion_9"}
    g = bench.idle_gaps(spans, names)
    assert g["by_length"]["<2us"] == {"count": 1, "idle_us": 1.0}
    assert g["by_length"]["<200us"] == {"count": 1, "idle_us": 100.0}
    assert g["by_length"][">=1000us"] == {"count": 1, "idle_us": 1500.0}
    assert sum(v["count"] for v in g["by_length"].values()) == 3
    # the gap after the overlap follows the kernel that ended last (gemm, not fusion_2)
    assert g["longest_after_before"] == [{"between": "attn -> fusion", "count": 1, "idle_us": 1500.0},
                                         {"between": "gemm -> attn", "count": 1, "idle_us": 100.0}]
    # the short gap (1 us) counts before the kernel that follows it
    assert g["short_before"][0] == {"family": "fusion", "kernels": 2, "gaps": 1, "idle_us": 1.0}
    assert {f["family"]: f["gaps"] for f in g["short_before"]} == {"fusion": 1, "gemm": 0, "attn": 0}
    assert "long_by_module" not in g
    # with each span's module: the 1.5 ms gap sits between two modules; a 2 ms gap inside one
    spans.append((3630 * us, 3640 * us))
    names[spans[5]] = "fusion_10"
    modules = {spans[0]: "jit_a", spans[1]: "jit_a", spans[2]: "jit_a", spans[3]: "jit_a", spans[4]: "jit_b",
               spans[5]: "jit_b"}
    g = bench.idle_gaps(spans, names, modules)
    assert g["long_by_module"] == [{"between": "jit_b -> jit_b", "count": 1, "idle_us": 2000.0},
                                   {"between": "jit_a -> jit_b", "count": 1, "idle_us": 1500.0}]


def test_engine_thread_in_long_gaps(bench: ModuleType) -> None:
    from types import SimpleNamespace as NS

    ms = 1_000_000  # ns
    spans = [(0, 1 * ms), (1 * ms + 500, 2 * ms), (5 * ms, 6 * ms), (6 * ms, 7 * ms), (9 * ms, 10 * ms)]
    gaps = bench.long_gaps(spans)
    assert gaps == [(2 * ms, 5 * ms), (7 * ms, 9 * ms)]  # the 0.5 us gap is not one

    def ev(s0: int, e0: int, name: str) -> NS:
        return NS(start_ns=s0, end_ns=e0, name=name)

    engine = NS(name="kestrel-jax-engine", events=[
        ev(1 * ms, 4 * ms, "kestrel_jax.launch_mixed"), ev(3 * ms, 4 * ms, "Execute"),  # nested
        ev(8 * ms, 8 * ms + ms // 2, "kestrel_jax.wait_outputs")])
    other = NS(name="vision", events=[ev(0, 10 * ms, "kestrel_jax.image_wait")])  # fewer ranges: not it
    data = NS(planes=[NS(name="/device:GPU:0", lines=[]), NS(name="/host:CPU", lines=[other, engine])])
    r = bench.engine_thread_in_gaps(data, gaps)
    assert r["line"] == "kestrel-jax-engine" and r["gaps"] == 2 and r["idle_us"] == 5000.0
    assert {e["name"]: e["us"] for e in r["by_event"]} == {"kestrel_jax.launch_mixed": 2000.0, "Execute": 1000.0,
                                                           "kestrel_jax.wait_outputs": 500.0}
    assert r["outside_any_event_us"] == 2500.0  # 4-5 ms and 7-8, 8.5-9 ms
    assert "error" in bench.engine_thread_in_gaps(NS(planes=[]), gaps)


def test_command_buffer_updates_by_module(bench: ModuleType) -> None:
    from types import SimpleNamespace as NS

    def ev(s0: int, e0: int, name: str, **stats: Any) -> NS:
        return NS(start_ns=s0, end_ns=e0, name=name, stats=list(stats.items()))

    us = 1000  # ns
    engine = NS(name="engine", events=[
        ev(0, 900 * us, "jit_call:XLA GPU module"), ev(10 * us, 610 * us, "command_buffer::update", num_commands=901),
        ev(1000 * us, 1500 * us, "jit_call:XLA GPU module"),
        ev(1100 * us, 1300 * us, "command_buffer::update", num_commands=901),
        ev(2000 * us, 2400 * us, "jit__copy_pages:XLA GPU module"),
        ev(2000 * us, 2235 * us, "command_buffer::update", num_commands=50),
        ev(3000 * us, 3100 * us, "command_buffer::initialize", num_commands=7),  # outside any module
        ev(3000 * us, 3300 * us, "kestrel_jax.launch_mixed")])
    data = NS(planes=[NS(name="/device:GPU:0", lines=[]), NS(name="/host:CPU", lines=[engine])])
    got = bench.command_buffer_updates(data)
    assert got == [
        {"thread": "engine", "module": "jit_call", "kind": "update", "num_commands": 901, "count": 2, "us": 800.0,
         "us_each": 400.0},
        {"thread": "engine", "module": "jit__copy_pages", "kind": "update", "num_commands": 50, "count": 1,
         "us": 235.0, "us_each": 235.0},
        {"thread": "engine", "module": "?", "kind": "initialize", "num_commands": 7, "count": 1, "us": 100.0,
         "us_each": 100.0}]
    assert bench.command_buffer_updates(NS(planes=[])) == []


def test_graph_launch_gaps(bench: ModuleType) -> None:
    from types import SimpleNamespace as NS

    def ev(s0: int, e0: int, graph: int | None) -> NS:
        return NS(start_ns=s0, end_ns=e0, name="k", stats=[("cuda_graph_id", graph)] if graph is not None else [])

    us = 1000  # ns
    # graph 7: four kernels, gaps 0.5, -0.25 (overlap), 1.0 us; graph 9 (other stream): one gap of 2 us;
    # kernels outside any graph and pairs across graphs are not counted
    compute = NS(name="Stream #14", events=[ev(3 * us + 750, 5 * us, 7), ev(0, 1 * us, 7), ev(1500, 4 * us, 7),
                                            ev(6 * us, 7 * us, 7), ev(8 * us, 9 * us, None), ev(10 * us, 11 * us, 8)])
    other = NS(name="Stream #15", events=[ev(0, 1 * us, 9), ev(3 * us, 4 * us, 9)])
    data = NS(planes=[NS(name="/device:GPU:0", lines=[compute, other]), NS(name="/host:CPU", lines=[compute])])
    assert bench.graph_launch_gaps(data, min_pairs=1) == [
        {"graph": 7, "pairs": 3, "median_gap_us": 0.5, "mean_gap_us": 0.417, "overlap_fraction": 0.333},
        {"graph": 9, "pairs": 1, "median_gap_us": 2.0, "mean_gap_us": 2.0, "overlap_fraction": 0.0}]
    assert bench.graph_launch_gaps(data, min_pairs=2) == bench.graph_launch_gaps(data, min_pairs=1)[:1]
    assert bench.graph_launch_gaps(NS(planes=[])) == []


def test_launch_ms_per_step(bench: ModuleType) -> None:
    host = {"launch_mixed": 2.0, "launch_decode": 0.75, "launch_prefill": 0.0, "dispatch": 9.0}
    sched = {"mixed_steps": 500, "decode_steps": 250, "prefill_steps": 0, "decode_iterations": 2000}
    assert bench.launch_ms_per_step(host, sched) == {"mixed": 4.0, "decode": 3.0}
    assert bench.launch_ms_per_step({}, sched) == {}
