"""Does batch-1 decode slow down as more GPU programs are loaded in the process?

The default decode bucket set (16 decode variants) runs MD3 batch-1 decode ~8% slower than
`decode_buckets=1` on the same machine, with the same kernels and kernel times: the GPU idles in
more, longer gaps between the kernels of a step (session 14, calls 1-2). This probe starts one
small-bucket engine, measures W1, then loads extra programs that W1 never runs and measures again:
the engine's own decode step at more batch buckets first (run, compiled only, or compiled without
XLA command buffers), optionally its 1-row steps loaded again, then command-buffer programs (and
their release), plain XLA programs and Mosaic GPU kernels (each its own GPU module, as each
distinct Pallas Mosaic GPU kernel of the engine's steps is), in growing counts.

    PYTHONPATH=. python3 tools/probe_loaded_modules.py --out probe.json [--quick]   (GPU)

`--quick` (a tiny model, few tokens, the Pallas interpreter for the kernels) runs on the CPU.
`--profiler-ranges` marks each stage's first W1 as a CUDA profiler range, so that one nsys run
(`--capture-range=cudaProfilerApi --capture-range-end=repeat`) captures every stage apart.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import functools
import gc
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.benchmark import MODELS, Bench, engine_config, log  # noqa: E402


def xla_programs(n: int, offset: int) -> list[Any]:
    """n distinct small XLA programs (a few fusions each), compiled and run once."""
    keep = []
    for i in range(offset, offset + n):
        f = jax.jit(lambda x, c=float(i): jnp.tanh(x * c).sum(0) + jnp.exp(x - c).max(0))
        jax.block_until_ready(f(jnp.ones((64, 128), jnp.float32)))
        keep.append(f)
    return keep


def graph_programs(n: int, offset: int, depth: int = 20) -> list[Any]:
    """n distinct XLA programs of `depth` small GEMMs, each followed by an elementwise fusion: on
    the GPU each program's ~2 * depth kernels form one XLA command buffer (a CUDA graph), so the
    process holds ~2 * depth * n more graph nodes once each has run."""
    keep = []
    w = jnp.eye(64, dtype=jnp.float32)
    for i in range(offset, offset + n):
        def f(x, w, c=float(i)):
            for j in range(depth):
                x = jnp.tanh(x @ w + (c + j))
            return x
        g = jax.jit(f)
        jax.block_until_ready(g(jnp.ones((64, 64), jnp.float32), w))
        keep.append(g)
    return keep


def mosaic_kernels(n: int, offset: int, interpret: bool) -> list[Any]:
    """n distinct Mosaic GPU kernels, compiled, loaded and run once: the project's decode GEMM
    kernel at n different output widths (each width is its own kernel, so its own GPU module)."""
    from kestrel_jax.pallas.gemv_mgpu import BLOCK_K, BLOCK_N, gemv

    keep = []
    x = jnp.ones((1, 2 * BLOCK_K), jnp.bfloat16)
    for i in range(offset, offset + n):
        width = BLOCK_N * (i + 2)
        w = jnp.full((2 * BLOCK_K, width), 0.5, jnp.bfloat16)
        f = jax.jit(functools.partial(gemv, interpret=interpret))
        out = jax.block_until_ready(f(x, w))
        assert out.shape == (1, width) and float(out[0, -1]) == BLOCK_K, (out.shape, float(out[0, -1]))
        keep.append(f)
    return keep


def decode_variants(engine: Any, buckets: list[int], options: dict[str, Any] | None = None,
                    run: bool = True) -> list[Any]:
    """The engine's own decode step at more batch buckets (1 and `decode_steps` iterations each, as
    its warm-up makes them): compiled side by side, then run once with inert rows (no KV writes),
    while the engine is idle. The runner's recompile guard is lifted meanwhile. With `options`
    (XLA compile options, e.g. command buffers off) each variant is compiled with them outside the
    runner's caches instead; the compiled programs are returned to be kept alive. `run=False`:
    compiled only (XLA's autotuning runs its candidates on the GPU then, the program does not)."""
    from kestrel_jax.serving import batch as bt

    worker = engine._worker
    runner = worker.runner
    pages = runner.max_pages_per_seq
    calls = [("decode", (*bt.empty_decode(b, pages), None, k)) for b in buckets
             for k in sorted({1, worker.config.decode_steps})]
    if options is not None:
        keep = []
        for _, (ints, floats, prev, k) in calls:
            args = (runner.lm_params, runner.cache, ints, floats, runner._feed(prev))
            compiled = runner._decode_fn(k).jitted.lower(*args).compile(compiler_options=options)
            runner.cache, outs, _ = compiled(*args)  # the KV pool is donated, as in runner.decode
            jax.block_until_ready(outs)
            keep.append(compiled)
        return keep
    runner.unfreeze()
    try:
        runner.compile_ahead(calls, worker.compile_threads)
        for _, (ints, floats, prev, k) in calls if run else []:
            jax.block_until_ready(runner.decode(ints, floats, prev, k))
    finally:
        runner.freeze()
    return []


def reload_base(engine: Any, keep: list[Any]) -> bool:
    """Load the engine's own 1-row decode steps again as new executables (from the export and
    compile caches; the old ones kept alive): is the slow state tied to programs loaded before
    the trigger? Returns whether both were replaced."""
    from kestrel_jax.serving import batch as bt
    from kestrel_jax.serving.export_cache import _quick_sig

    worker = engine._worker
    runner = worker.runner
    ints, floats = bt.empty_decode(1, runner.max_pages_per_seq)
    sig = _quick_sig((runner.lm_params, runner.cache, ints, floats, runner._feed(None)))
    replaced = True
    runner.unfreeze()
    try:
        for k in sorted({1, worker.config.decode_steps}):
            step = runner._decode_fn(k)
            old = step._variants.pop(sig, None)
            keep.append(old)
            jax.block_until_ready(runner.decode(ints, floats, None, k))
            replaced &= old is not None and all(v is not old for v in step._variants.values())
    finally:
        runner.freeze()
    return replaced


def profiler(start: bool) -> None:
    """cuProfilerStart / cuProfilerStop (CUDA driver API): bounds a capture range for an external
    profiler (`nsys profile --capture-range=cudaProfilerApi --capture-range-end=repeat`)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise RuntimeError(f"--profiler-ranges needs the CUDA driver (libcuda.so.1): {e}") from e
    # The calls act on the calling thread's current context: make it device 0's primary context,
    # the one XLA runs in (this thread may have none current).
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    calls: list[tuple[str, Callable[[], int]]] = [
        ("cuInit", lambda: cuda.cuInit(0)),
        ("cuDeviceGet", lambda: cuda.cuDeviceGet(ctypes.byref(dev), 0)),
        ("cuDevicePrimaryCtxRetain", lambda: cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)),
        ("cuCtxSetCurrent", lambda: cuda.cuCtxSetCurrent(ctx)),
        ("cuProfilerStart" if start else "cuProfilerStop", cuda.cuProfilerStart if start else cuda.cuProfilerStop),
    ]
    for name, call in calls:
        rc = call()
        if rc != 0:
            raise RuntimeError(f"{name} returned CUDA error {rc}")


async def main(a: argparse.Namespace) -> dict[str, Any]:
    from kestrel_jax.models.moondream import random_model
    from kestrel_jax.serving.engine import InferenceEngine

    factory, kw = MODELS[a.model]
    model = random_model(factory(), dtype=jnp.bfloat16, fp8_experts=bool(kw.get("fp8_experts")),
                         kv_scale=0.05 if kw.get("kv_scales") else None)
    cfg = engine_config("random-weights", a.engine_args, a.compile_cache)
    # One kernel before the engine compiles anything: the first Pallas call can import modules that
    # register JAX config options, and a new option changes every jit cache key (the engine's
    # recompile guard would then refuse its own steps).
    first = mosaic_kernels(1, -1, interpret=a.quick) if a.mosaic else []
    t0 = time.perf_counter()
    engine = await InferenceEngine.create(cfg, model=model)
    res: dict[str, Any] = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
                           "engine_args": a.engine_args, "startup_s": round(time.perf_counter() - t0, 1), "stages": []}
    log(f"engine ready in {res['startup_s']} s")
    args = argparse.Namespace(w1_tokens=a.w1_tokens, w1_reps=a.w1_reps, warmup=1, host_profile=False, seed=1234,
                           trace_dir=a.trace_dir, trace_seconds=0.5)
    bench = Bench(engine, args, {}, lambda: None)
    keep: list[Any] = first
    plan: list[tuple[str, Any, Any]] = [("base", 0, 0)]
    plan += [("decode", [int(b) for b in g.split(",")], None) for g in a.decode_buckets]
    compiled_only = [[int(b) for b in g.split(",")] for g in a.decode_buckets_compile]
    plan += [("decode-compile", g, None) for g in compiled_only]
    plan += [("decode", sum(compiled_only, []), None)] * bool(compiled_only)
    plan += [("decode-nocb", [int(b) for b in g.split(",")], None) for g in a.decode_buckets_nocb]
    plan += [("reload-base", None, None)] * a.reload_base
    plan += [("graph", n, None) for n in a.graph] + [("release", None, None)] * bool(a.graph)
    plan += [("xla", n, 0) for n in a.xla] + [("mosaic", 0, n) for n in a.mosaic]
    xla_total = mosaic_total = graph_total = 0
    extra_buckets: list[int] = []
    graphs: list[Any] = []
    try:
        for name, nx, nm in plan:
            t1 = time.perf_counter()
            if name in ("decode", "decode-nocb", "decode-compile"):
                opts = {"xla_gpu_enable_command_buffer": ""} if name == "decode-nocb" else None
                keep += decode_variants(engine, nx, opts, run=name != "decode-compile")
                extra_buckets += [b for b in nx if b not in extra_buckets]
                nx, nm = xla_total, mosaic_total
            elif name == "reload-base":
                res["reloaded"] = reload_base(engine, keep)
                nx, nm = xla_total, mosaic_total
            elif name == "graph":
                graphs += graph_programs(nx - graph_total, graph_total, a.graph_depth)
                graph_total = nx
                nx, nm = xla_total, mosaic_total
            elif name == "release":  # the graph programs dropped again: is the state reversible?
                graphs.clear()  # (not jax.clear_caches: the engine's own steps would recompile)
                gc.collect()
                graph_total = 0
                nx, nm = xla_total, mosaic_total
            if nx > xla_total:
                keep += xla_programs(nx - xla_total, xla_total)
                xla_total = nx
            if nm > mosaic_total:
                keep += mosaic_kernels(nm - mosaic_total, mosaic_total, interpret=a.quick)
                mosaic_total = nm
            load_s = time.perf_counter() - t1
            reps = []
            for i in range(a.repeats):
                ranged = a.profiler_ranges and i == 0
                if ranged:
                    profiler(True)
                try:
                    w1 = await bench.w1()
                finally:
                    if ranged:
                        profiler(False)
                reps.append(w1["summary"]["decode_tok_s_per_seq_p50"])
            stage = {"stage": name, "extra_decode_buckets": list(extra_buckets), "extra_graph_programs": graph_total,
                     "extra_xla_programs": xla_total,
                     "extra_mosaic_kernels": mosaic_total,
                     "load_s": round(load_s, 1), "w1_tok_s": reps}
            res["stages"].append(stage)
            log(f"stage {stage}")
            if a.out:  # a killed run keeps the stages it measured
                Path(a.out).write_text(json.dumps(res, indent=1))
        if a.trace_dir:  # last: the profiler can leave the CUDA context broken after a trace
            res["trace"] = await bench._guarded_trace(bench._traced_decode(bench.settings(a.w1_tokens)))
    except Exception as e:  # noqa: BLE001 - report the stages measured so far
        res["error"] = repr(e)
        log(f"stage failed: {e!r}")
    finally:
        await engine.shutdown()
    return res


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="md3", choices=sorted(MODELS))
    ap.add_argument("--engine-args", nargs="*", default=["decode_buckets=1", "prefill_token_buckets=1024",
                                                         "runner.vision_buckets=1", "runner.vision_image_batches=()"])
    ap.add_argument("--compile-cache", default=None)
    ap.add_argument("--decode-buckets", nargs="*", default=[],
                    help="groups of extra decode buckets loaded per stage, first (e.g. 2,4 8,16 32,48,64); "
                         "the engine must have output rows for the largest (mixed_decode_buckets=64)")
    ap.add_argument("--decode-buckets-compile", nargs="*", default=[],
                    help="groups of extra decode buckets compiled but not run, per stage, after --decode-buckets; "
                         "then one more stage runs them all")
    ap.add_argument("--decode-buckets-nocb", nargs="*", default=[],
                    help="groups of extra decode buckets loaded per stage after --decode-buckets, compiled "
                         "with XLA command buffers off")
    ap.add_argument("--graph", type=int, nargs="*", default=[],
                    help="cumulative extra command-buffer programs (--graph-depth GEMMs and fusions each) per stage, "
                         "then a stage with them released")
    ap.add_argument("--reload-base", action="store_true",
                    help="after the decode stages, load the engine's 1-row decode steps again and measure")
    ap.add_argument("--graph-depth", type=int, default=20, help="GEMMs (and fusions) per command-buffer program")
    ap.add_argument("--xla", type=int, nargs="*", default=[64], help="cumulative extra XLA programs per stage")
    ap.add_argument("--mosaic", type=int, nargs="*", default=[24, 48, 96],
                    help="cumulative extra Mosaic GPU kernels per stage (after the XLA stages)")
    ap.add_argument("--profiler-ranges", action="store_true",
                    help="bound each stage's first W1 measurement with cuProfilerStart/Stop, for an nsys "
                         "capture of every stage (GPU only)")
    ap.add_argument("--trace-dir", default=None, help="after the stages, a trace of batch-1 decode (idle gaps)")
    ap.add_argument("--w1-tokens", type=int, default=512)
    ap.add_argument("--w1-reps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2, help="W1 measurements per stage")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model, interpreted kernels")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.quick:
        a.model = "tiny-md3"
        a.w1_tokens, a.w1_reps, a.repeats = 4, 1, 1
        a.engine_args = ["dtype=float32", "runner.kv_dtype=f32", "decode_buckets=1", "prefill_token_buckets=768",
                         "max_prefill_seqs=1", "mixed_decode_buckets=4", "runner.vision_buckets=2",
                         "runner.num_pages=32", "runner.max_seq_len=832", "runner.vision_image_batches=()"]
    return a


if __name__ == "__main__":
    args = parse_args()
    out = asyncio.run(main(args))
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
