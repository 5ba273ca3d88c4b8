#!/usr/bin/env python3
"""Decode-loop A/B on one engine: batch-1 TTFT and decode tokens/s for the loop's variants
(pipelined or synchronous, 1 or K decode iterations per launch), a short concurrent run, the
kernels per decode step (from XLA's optimized HLO), compile time per step variant, and where the
host time of the loop goes. Random weights made on the device (seconds; no checkpoint).

  PYTHONPATH=. python3 tools/decode_ab.py --model md2 --out md2_ab.json --compile-cache /tmp/jc
  PYTHONPATH=. python3 tools/decode_ab.py --model md2 --compile-cache /tmp/jc --startup-only \\
      --out md2_warm.json                      # second process: start-up with a warm cache
  PYTHONPATH=. python3 tools/decode_ab.py --model tiny-md2 --tokens 16 --concurrency 2   # CPU smoke

Requests are the serving benchmark's (tools/benchmark.py): "What is in this image?" on a new random
378 px image, greedy, EOS ignored so every answer runs to --tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import glob
import json
import os
import platform
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Opcodes that launch nothing on the device.
_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while", "conditional", "call",
         "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency"}
_COMP = re.compile(r"^(ENTRY )?%?([\w.\-]+) [^{]*\{\s*$")
_INST = re.compile(r"=\s*(?:\([^=]*\)|[\w\[\]{}:,.\s/]+?)\s+([a-z][\w\-]*)\(")


def hlo_census(text: str) -> dict[str, Any]:
    """Device ops per execution of an optimized HLO module: the ENTRY computation's and, for each
    while loop, its body's (one iteration), following calls (command buffers)."""
    comps: dict[str, list[str]] = {}
    entry, cur = None, None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m:
            cur = m.group(2)
            comps[cur] = []
            if m.group(1):
                entry = cur
            continue
        if cur is not None:
            if line.strip() == "}":
                cur = None
            else:
                comps[cur].append(line)

    def count(name: str, seen: set[str]) -> tuple[Counter[str], list[str]]:
        ops: Counter[str] = Counter()
        loops: list[str] = []
        for line in comps.get(name, []):
            line = re.sub(r"/\*.*?\*/", "", line)
            m = _INST.search(line)
            if not m:
                continue
            op = m.group(1)
            if op == "custom-call":
                tgt = re.search(r'custom_call_target="([^"]+)"', line)
                op = f"custom-call:{tgt.group(1) if tgt else '?'}"
            if op == "fusion":
                kind = re.search(r"kind=(\w+)", line)
                op = f"fusion:{kind.group(1) if kind else '?'}"
            if op == "while":
                body = re.search(r"body=%?([\w.\-]+)", line)
                if body:
                    loops.append(body.group(1))
            if op == "call":
                callee = re.search(r"to_apply=%?([\w.\-]+)", line)
                if callee and callee.group(1) not in seen:
                    sub, sub_loops = count(callee.group(1), seen | {callee.group(1)})
                    ops.update(sub)
                    loops += sub_loops
                ops["call"] += 1
                continue
            ops[op] += 1
        return ops, loops

    if entry is None:
        return {"error": "no ENTRY computation found"}
    ops, loops = count(entry, {entry})
    out: dict[str, Any] = {"entry_kernels": sum(v for k, v in ops.items() if k not in _FREE),
                           "entry_ops": dict(ops.most_common()), "loops": []}
    for body in loops:
        b_ops, _ = count(body, {body})
        out["loops"].append({"body": body, "kernels_per_iteration": sum(v for k, v in b_ops.items() if k not in _FREE),
                             "ops": dict(b_ops.most_common())})
    return out


def census_from_dump(dump_dir: str) -> dict[str, Any]:
    out = {}
    for path in sorted(glob.glob(os.path.join(dump_dir, "*after_optimizations.txt"))):
        name = os.path.basename(path)
        if "decode_step" not in name and "prefill_step" not in name:
            continue
        out[name] = hlo_census(Path(path).read_text())
    return out


_DURATIONS: dict[str, list[float]] = {}
_EVENTS: dict[str, int] = {}


def _listen() -> None:
    """Collect JAX's compile-phase durations (tracing, lowering to MLIR, XLA compile, cache I/O)."""
    import jax

    def on_duration(event: str, duration_secs: float, **_: Any) -> None:
        _DURATIONS.setdefault(event, []).append(duration_secs)

    def on_event(event: str, **_: Any) -> None:
        if "cache" in event:  # persistent compilation cache hits / misses
            _EVENTS[event] = _EVENTS.get(event, 0) + 1

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)


def _durations() -> dict[str, Any]:
    out: dict[str, Any] = {k: {"n": len(v), "total_s": round(sum(v), 2), "max_s": round(max(v), 2)}
                           for k, v in _DURATIONS.items()}
    out["events"] = dict(_EVENTS)
    return out


async def run(a: argparse.Namespace) -> dict[str, Any]:
    import jax

    _listen()

    from kestrel_jax.models.config import md2_config, md3_config, tiny_config
    from kestrel_jax.models.moondream import random_model
    from kestrel_jax.serving.engine import EngineConfig, InferenceEngine, Result
    from kestrel_jax.serving.runner import RunnerConfig

    cfgs = {"md2": md2_config, "md3": md3_config, "tiny-md2": lambda: tiny_config("md2"),
            "tiny-md3": lambda: tiny_config("md3")}
    md3 = a.model.endswith("md3")
    res: dict[str, Any] = {"model": a.model, "argv": sys.argv, "host": platform.node(),
                           "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
                           "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    t0 = time.perf_counter()
    model = random_model(cfgs[a.model](), fp8_experts=md3, kv_scale=0.05 if md3 else None)
    jax.block_until_ready(jax.tree.leaves(model))
    res["model_s"] = round(time.perf_counter() - t0, 2)
    buckets = tuple(a.buckets)
    ecfg = EngineConfig(
        runner=RunnerConfig(max_seq_len=2048, vision_buckets=(2,), compilation_cache_dir=a.compile_cache),
        decode_buckets=buckets, prefill_token_buckets=(1024,), max_prefill_seqs=8, decode_steps=a.steps,
        multi_step_max_batch=max(buckets))
    t0 = time.perf_counter()
    eng = await InferenceEngine.create(ecfg, model=model)
    res["create_s"] = round(time.perf_counter() - t0, 2)
    worker = eng._worker
    res["compile_s"] = dict(worker.compile_s)
    res["compile_phases"] = _durations()
    res["cache_entries"] = len(os.listdir(a.compile_cache)) if a.compile_cache else None
    print(json.dumps({k: res[k] for k in ("device", "model_s", "create_s", "compile_s", "compile_phases")}),
          flush=True)
    if a.startup_only:
        await eng.shutdown()
        return res
    rng = np.random.default_rng(0)
    settings = {"temperature": 0.0, "max_tokens": a.tokens, "ignore_eos": True}

    def image() -> np.ndarray:
        return rng.integers(0, 255, (378, 378, 3), dtype=np.uint8)

    def reset_host() -> None:
        for k in worker.host_s:
            worker.host_s[k] = 0.0
        worker.stepper.wait_s = 0.0

    def host_report(tokens: int) -> dict[str, float]:
        h = {**worker.host_s, "wait_outputs": worker.stepper.wait_s}
        return {f"{k}_us_per_token": round(1e6 * v / max(tokens, 1), 1) for k, v in h.items()}

    first = await eng.query(image(), "What is in this image?", reasoning=False, settings=settings)
    res["first_request_ttft_ms"] = round(first.metrics.ttft_ms, 2) if isinstance(first, Result) else None
    print(json.dumps({"first_request_ttft_ms": res["first_request_ttft_ms"]}), flush=True)
    rows = []
    for pipe, k in [(True, 1), (False, 1), (True, a.steps), (False, a.steps), (True, 1), (True, a.steps)]:
        worker.config = dataclasses.replace(worker.config, pipeline=pipe, decode_steps=k)
        reset_host()
        ttft, tps, wall = [], [], []
        for _ in range(a.reps):
            t = time.perf_counter()
            r = await eng.query(image(), "What is in this image?", reasoning=False, settings=settings)
            wall.append(time.perf_counter() - t)
            assert isinstance(r, Result) and r.metrics.output_tokens == a.tokens, r
            ttft.append(r.metrics.ttft_ms)
            tps.append(r.metrics.tokens_per_s)
        row = {"pipeline": pipe, "decode_steps": k, "ttft_ms": [round(x, 2) for x in ttft],
               "decode_tok_s": [round(x, 1) for x in tps], "ms_per_token": round(1e3 / float(np.median(tps)), 3),
               "request_s": [round(x, 3) for x in wall], **host_report(a.tokens * a.reps)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    res["batch1"] = rows
    conc = []
    for k in (1, a.steps):
        for c in a.concurrency:
            worker.config = dataclasses.replace(worker.config, pipeline=True, decode_steps=k)
            reset_host()
            t = time.perf_counter()
            rs = await asyncio.gather(*(eng.query(image(), "What is in this image?", reasoning=False,
                                                  settings=settings) for _ in range(c * a.rounds)))
            # c * rounds requests submitted at once; the engine runs at most its largest bucket at a time
            dt = time.perf_counter() - t
            ok = [r for r in rs if isinstance(r, Result)]
            toks = sum(r.metrics.output_tokens for r in ok)
            row = {"requests": c * a.rounds, "max_batch": max(buckets), "decode_steps": k, "ok": len(ok),
                   "wall_s": round(dt, 3), "output_tok_s": round(toks / dt, 1),
                   "ttft_ms_p50": round(float(np.median([r.metrics.ttft_ms for r in ok])), 1),
                   **host_report(toks)}
            print(json.dumps(row), flush=True)
            conc.append(row)
    res["burst"] = conc
    res["stats"] = {k: v for k, v in eng.stats.items() if k in ("steps", "num_pages", "kv_dtype")}
    await eng.shutdown()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="md2", choices=["md2", "md3", "tiny-md2", "tiny-md3"])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8, help="decode iterations per multi-step launch")
    ap.add_argument("--buckets", type=int, nargs="+", default=[1, 8], help="decode batch buckets")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[8], help="burst sizes (each x --rounds)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--compile-cache", default=None)
    ap.add_argument("--startup-only", action="store_true")
    ap.add_argument("--census", action="store_true", help="dump optimized HLO and count kernels per step")
    ap.add_argument("--out", default=None)
    ap.add_argument("--hlo-tar", default=None, help="with --census: also save the optimized HLO texts here (.tar.gz)")
    ap.add_argument("--no-burst", action="store_true")
    a = ap.parse_args()
    if a.no_burst:
        a.concurrency = []
    dump = None
    if a.census:
        dump = tempfile.mkdtemp(prefix="kjx_hlo_")
        flags = f"--xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*(decode|prefill)_step.*"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()
    res = asyncio.run(run(a))
    if dump is not None:
        res["census"] = census_from_dump(dump)
        if a.hlo_tar:
            import tarfile

            with tarfile.open(a.hlo_tar, "w:gz") as tar:
                for path in glob.glob(os.path.join(dump, "*_step*after_optimizations.txt")):
                    tar.add(path, arcname=os.path.basename(path))
        for name, c in res["census"].items():
            print(name, json.dumps({k: v for k, v in c.items() if k != "entry_ops"})[:2000], flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
