"""Serving benchmark: the engine's public API on a random-weight checkpoint, Kestrel's workload.

    python tools/benchmark.py --model md3 --out md3.json --trace-dir /tmp/trace
    python tools/benchmark.py --model md3 --checkpoint /tmp/md3 --prepare-only    # write it, exit
    python tools/benchmark.py --model md3 --checkpoint /tmp/md3 --compile-cache /tmp/jc \\
        --append --out md3.json             # start-up only, added to md3.json (warm cache: 2nd process)
    python tools/benchmark.py compare --ours md3.json md2.json --peer peer/md3.json peer/md2.json
    python tools/benchmark.py --model tiny-md3 --quick --engine-args decode_buckets=2   # CPU smoke run

Requests are those of the Kestrel harness (../shared/peer/bench_kestrel.py): `query(image, "What is
in this image?", reasoning=False)`, greedy (temperature 0, top_p 1), a new random RGB image each
time (so the prefix cache never hits unless a workload wants it to), plus `ignore_eos` so every
answer runs to max_tokens. Without --checkpoint a synthetic one is written to a temp dir (timed):
MD3 with FP8 experts and KV scales (Kestrel's defaults: FP8 MoE, FP8 KV cache), MD2 in bf16.
Workloads (--workloads; --quick shrinks every count for a CPU smoke run):
  startup  InferenceEngine.create time (cold or warm persistent compilation cache)
  w1       batch-1 decode of 512 tokens: tokens/s, ms/token, achieved GB/s vs measured copy GB/s;
           with --trace-dir, a profile of 0.5 s of pure batch-1 decode (kernels per decode step, and
           every kernel family per decode iteration, also printed to the log)
  w2       C closed-loop clients (8, 32, 64), 378 px, 128 tokens: req/s, output tok/s, TTFT P50/P90;
           with --trace-dir, a jax.profiler trace of a steady window at the highest C
  w3       256 short answers (8 tokens) at concurrency 1 and 64: req/s, latency P50/P99
  w4       TTFT for 378 px, 756 px and 768x1024 (13 crops) images, cold and prefix-cache warm
Each workload records its own failure and the rest go on; the JSON is rewritten after each one.
Profiling on the GPU can leave the CUDA context broken once the trace stops (the next device sync
reports CUDA_ERROR_LAUNCH_FAILED; seen on the H100 here with and without our kernels, and upstream
as jax-ml/jax#40260): traces are taken after a workload's measurements, and the window's summary
is kept when the request it interrupted fails.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import dataclasses
import gzip
import importlib.metadata as im
import json
import math
import os
import platform
import re
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from kestrel_jax.models.config import MoondreamConfig, md2_config, md3_config, tiny_config  # noqa: E402

QUESTION = "What is in this image?"


def _shallow(cfg: MoondreamConfig, *, text_layers: int, vision_layers: int) -> MoondreamConfig:
    return dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, n_layers=text_layers),
                               vision=dataclasses.replace(cfg.vision, enc_n_layers=vision_layers)).validate()


MODELS: dict[str, tuple[Callable[[], MoondreamConfig], dict[str, bool]]] = {
    # MD3 as Kestrel runs it by default: FP8 experts and an FP8 KV cache (per-layer scales).
    "md3": (md3_config, {"fp8_experts": True, "kv_scales": True}),
    "md2": (md2_config, {}),
    # CPU smoke runs (--quick): the tiny sizes with a 2-layer vision encoder (compiles in seconds)
    "tiny-md3": (lambda: tiny_config("md3", vision_layers=2), {"fp8_experts": True, "kv_scales": True}),
    "tiny-md2": (lambda: tiny_config("md2", vision_layers=2), {}),
    # MD3's widths with 6 text layers (2 of them MoE) and 2 vision layers: every kernel at its
    # production shapes in a fraction of the memory and time (GPU checks such as compute-sanitizer)
    "md3-short": (lambda: _shallow(md3_config(), text_layers=6, vision_layers=2),
                  {"fp8_experts": True, "kv_scales": True}),
}
PEER_NAMES = {"moondream3-preview": "md3", "moondream2": "md2"}
WORKLOADS = ("startup", "w1", "w4", "w2", "w3")  # run order: the side-by-side figures first
# (full, quick) values for options left unset
SIZES: dict[str, tuple[Any, Any]] = {
    "max_tokens": (128, 4), "requests_per_client": (4, 1), "warmup": (1, 0),
    "w1_tokens": (512, 8), "w1_reps": (3, 1),
    "w3_requests": (256, 2), "w3_tokens": (8, 2), "w3_concurrency": ([1, 64], [1, 2]),
    "w4_images": (["378x378", "756x756", "768x1024"], ["378x378", "300x500"]), "w4_reps": (3, 1),
    "trace_seconds": (2.0, 0.5), "bandwidth_mib": (1024, 16),
}
MIN_WORKLOAD_S = 20.0  # a workload is not started with less time left (quick: 2 s)


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pct(xs: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for no data."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def rnd(x: float | None, n: int = 2) -> float | None:
    return None if x is None else round(float(x), n)


def parse_hw(spec: str) -> tuple[int, int]:
    h, _, w = spec.lower().partition("x")
    return int(h), int(w)


class Images:
    """Random RGB uint8 images, a different one on every call (never a prefix-cache hit)."""

    def __init__(self, seed: int):
        self._rng = np.random.default_rng(seed)

    def new(self, h: int = 378, w: int = 378) -> np.ndarray:
        return self._rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)


# ---------------------------------------------------------------------------------- environment
def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "flax", "numpy",
                 "ml-dtypes", "tokenizers", "safetensors"):
        try:
            out[name] = im.version(name)
        except im.PackageNotFoundError:
            out[name] = None
    return out


def device_info() -> dict[str, Any]:
    import jax

    dev = jax.devices()[0]
    from kestrel_jax import xla_defaults
    from kestrel_jax.serving.runner import client_memory_fraction, gpu_memory_info

    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    limit = stats["bytes_limit"] if stats and "bytes_limit" in stats else None
    info = gpu_memory_info(dev) if limit is None else None
    if info is not None:  # XLA's VMM allocator (SKIP_TEMP command buffers) keeps no statistics
        limit = info[1] * client_memory_fraction()
    return {"platform": dev.platform, "kind": dev.device_kind, "count": jax.device_count(),
            "host": platform.node(), "memory_limit_gib": rnd(limit / 2**30) if limit else None,
            "xla_defaults": xla_defaults.applied()}


def copy_bandwidth(mib: int, reps: int = 20) -> dict[str, Any]:
    """Device-to-device copy and `x + 1` over `mib` MiB; GB/s counts bytes read + written."""
    import jax
    import jax.numpy as jnp

    nbytes = mib << 20
    x = jnp.ones((nbytes // 4,), jnp.float32).block_until_ready()
    out: dict[str, Any] = {"bytes": nbytes, "reps": reps}
    fns = {"copy": jax.jit(lambda a: jnp.copy(a)), "add_one": jax.jit(lambda a: a + 1.0)}
    for name, fn in fns.items():
        fn(x).block_until_ready()
        t0 = time.perf_counter()
        for _ in range(reps):
            y = fn(x)
        y.block_until_ready()
        out[f"{name}_gbs"] = rnd(2 * nbytes / ((time.perf_counter() - t0) / reps) / 1e9, 1)
        del y
    del x
    out["ceiling_gbs"] = max(out["copy_gbs"], out["add_one_gbs"])
    return out


# ---------------------------------------------------------------------------------- checkpoint
def prepare_checkpoint(model: str, path: str | None, seed: int) -> tuple[Path, dict[str, Any], Path | None]:
    """Reuse a complete checkpoint at `path` or write one (timed). Returns (dir, info, temp dir to remove).

    The writer saves config.json after the weights are closed, so its presence means complete."""
    from kestrel_jax.checkpoint.synthetic import write_synthetic_checkpoint

    factory, kw = MODELS[model]
    tmp = None
    if path is None:
        tmp = Path(tempfile.mkdtemp(prefix=f"kjx-{model}-"))
        out = tmp
    else:
        out = Path(path)
    record = out / "benchmark_write.json"
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        info = json.loads(record.read_text()) if record.exists() else {}
        return out, {**info, "path": str(out), "reused": True}, tmp
    log(f"writing a synthetic {model} checkpoint to {out} ({kw or 'bf16'})")
    t0 = time.perf_counter()
    write_synthetic_checkpoint(out, factory(), seed=seed, overwrite=True, fp8_experts=kw.get("fp8_experts", False),
                               kv_scales=kw.get("kv_scales", False))
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    info = {"write_s": rnd(time.perf_counter() - t0), "bytes": size, "seed": seed, **kw}
    record.write_text(json.dumps(info) + "\n")
    log(f"checkpoint written: {size / 1e9:.2f} GB in {info['write_s']} s")
    return out, {**info, "path": str(out), "reused": False}, tmp


# ---------------------------------------------------------------------------------- engine
def _literal(raw: str) -> Any:
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


def engine_config(model_path: str, overrides: list[str], compile_cache: str | None) -> Any:
    """EngineConfig from `key=value` pairs; `runner.key=value` sets RunnerConfig fields.
    Values are Python literals (`decode_buckets=1,2` -> (1, 2); a single number where a tuple is
    expected becomes a 1-tuple)."""
    from kestrel_jax.serving.engine import EngineConfig
    from kestrel_jax.serving.runner import RunnerConfig

    kws: dict[str, dict[str, Any]] = {"engine": {}, "runner": {}}
    fields = {"engine": {f.name: f for f in dataclasses.fields(EngineConfig)},
              "runner": {f.name: f for f in dataclasses.fields(RunnerConfig)}}
    if compile_cache:
        kws["runner"]["compilation_cache_dir"] = compile_cache
    for item in overrides:
        key, eq, raw = item.partition("=")
        where, name = ("runner", key[len("runner."):]) if key.startswith("runner.") else ("engine", key)
        if not eq or name not in fields[where] or name == "runner":
            raise SystemExit(f"--engine-args: {item!r} is not KEY=VALUE with an EngineConfig field or "
                             f"runner.<RunnerConfig field>; fields: {sorted(fields['engine'])}, "
                             f"runner.{{{','.join(sorted(fields['runner']))}}}")
        value = _literal(raw)
        if value is not None and "tuple" in str(fields[where][name].type):
            value = tuple(value) if isinstance(value, list | tuple) else (value,)
        kws[where][name] = value
    return EngineConfig(model_path=model_path, runner=RunnerConfig(**kws["runner"]), **kws["engine"])


def config_dict(cfg: Any) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def decode_bytes(model: Any, *, batch: int, context: float, kv_dtype: str) -> dict[str, float]:
    """Bytes one decode step reads: text weights (embedding: one row per sequence), the experts a
    batch of `batch` touches (random routing: each expert is missed by a token with probability
    1 - k/E), and the KV cache of `batch` sequences of `context` positions. Vision and region
    weights are not read by a text decode step."""
    import jax.numpy as jnp
    from flax import nnx

    t = model.cfg.text
    moe = t.moe
    touched = moe.num_experts * (1.0 - (1.0 - moe.experts_per_token / moe.num_experts) ** batch) if moe else 0.0
    dense = expert = 0.0
    for path, var in nnx.to_flat_state(nnx.state(model)):
        if path[0] != "text":
            continue
        value = var.get_value()
        nbytes = math.prod(value.shape) * jnp.dtype(value.dtype).itemsize
        if path[-1] == "wte":
            dense += batch * value.shape[-1] * jnp.dtype(value.dtype).itemsize
        elif moe and "mlp" in path and path[-1] in ("fc1", "fc2", "fc1_scale", "fc2_scale") \
                and value.shape[0] == moe.num_experts:
            expert += nbytes * touched / moe.num_experts
        else:
            dense += nbytes
    kv = 2 * t.n_layers * t.n_kv_heads * t.head_dim * jnp.dtype(kv_dtype).itemsize * context * batch
    return {"weights_dense": dense, "experts_active": expert, "kv": kv, "total": dense + expert + kv}


# ---------------------------------------------------------------------------------- requests
async def one_request(engine: Any, image: np.ndarray, settings: dict[str, Any], *,
                      stream: bool = False) -> dict[str, Any]:
    t0 = time.perf_counter()
    first = None
    if stream:
        st = await engine.query(image, QUESTION, reasoning=False, stream=True, settings=settings)
        async for _ in st:
            first = first or time.perf_counter()
        res = await st.result()
    else:
        res = await engine.query(image, QUESTION, reasoning=False, settings=settings)
    t1 = time.perf_counter()
    m = res.metrics
    dec_s = m.decode_time_ms / 1e3
    return {"t0": t0, "wall_ms": (t1 - t0) * 1e3, "ttft_ms": m.ttft_ms, "prefill_ms": m.prefill_time_ms,
            "decode_ms": m.decode_time_ms, "queue_ms": m.queue_time_ms, "input_tokens": m.input_tokens,
            "output_tokens": m.output_tokens, "cached_tokens": m.cached_tokens, "finish": res.finish_reason,
            "client_ttft_ms": None if first is None else (first - t0) * 1e3,
            # the first token comes out of prefill; the rest are decode steps
            "decode_tok_s": (m.output_tokens - 1) / dec_s if dec_s > 0 and m.output_tokens > 1 else None}


def summarize(recs: list[dict[str, Any]], want_tokens: int) -> dict[str, Any]:
    def col(k: str) -> list[float]:
        return [r[k] for r in recs if r.get(k) is not None]

    short = sum(r["output_tokens"] != want_tokens for r in recs)
    return {"n": len(recs), "ttft_ms_p50": rnd(pct(col("ttft_ms"), 50)), "ttft_ms_p90": rnd(pct(col("ttft_ms"), 90)),
            "prefill_ms_p50": rnd(pct(col("prefill_ms"), 50)), "queue_ms_p50": rnd(pct(col("queue_ms"), 50)),
            "latency_ms_p50": rnd(pct(col("wall_ms"), 50)), "latency_ms_p90": rnd(pct(col("wall_ms"), 90)),
            "latency_ms_p99": rnd(pct(col("wall_ms"), 99)),
            "decode_tok_s_per_seq_p50": rnd(pct(col("decode_tok_s"), 50)),
            "client_ttft_ms_p50": rnd(pct(col("client_ttft_ms"), 50)),
            "input_tokens": sorted(set(col("input_tokens"))),
            "output_tokens_min": min(col("output_tokens"), default=None),
            "cached_tokens_max": max(col("cached_tokens"), default=None),
            "not_full_length": short}


def sched_stats(engine: Any) -> dict[str, int]:
    s = engine.stats["scheduler"]
    return dataclasses.asdict(s) if dataclasses.is_dataclass(s) and not isinstance(s, type) else dict(s)


def sched_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, Any]:
    d: dict[str, Any] = {k: after[k] - before.get(k, 0) for k in after}
    iterations = (d.get("decode_iterations") or d.get("decode_steps", 0)) + d.get("mixed_steps", 0)
    if iterations:  # a mixed step runs one decode iteration of its decode rows
        d["mean_decode_batch"] = rnd(d["decode_rows"] / iterations)
    return d


def launch_ms_per_step(host_s: dict[str, float], sched: dict[str, Any]) -> dict[str, float]:
    """The engine thread's host time per launch (ms) by step kind: `launch_<kind>` seconds over the
    scheduler's `<kind>_steps` count (a decode launch of several iterations counts once)."""
    out: dict[str, float] = {}
    for kind in ("mixed", "prefill", "decode"):
        n = sched.get(f"{kind}_steps", 0)
        if n and f"launch_{kind}" in host_s:
            out[kind] = round(host_s[f"launch_{kind}"] / n * 1e3, 3)
    return out


# ---------------------------------------------------------------------------------- workloads
class Bench:
    def __init__(self, engine: Any, args: argparse.Namespace, results: dict[str, Any], dump: Callable[[], None]):
        self.engine, self.a, self.results, self.dump = engine, args, results, dump
        self.images = Images(args.seed)

    def settings(self, max_tokens: int) -> dict[str, Any]:
        return {"temperature": 0.0, "top_p": 1.0, "max_tokens": max_tokens, "ignore_eos": True}

    async def w1(self) -> dict[str, Any]:
        n = self.a.w1_tokens
        st = self.settings(n)
        for _ in range(self.a.warmup):
            await one_request(self.engine, self.images.new(), st)
        t0 = time.perf_counter()
        with self._engine_thread() as host:
            recs = [await one_request(self.engine, self.images.new(), st) for _ in range(self.a.w1_reps)]
        s = summarize(recs, n)
        s.update(host, wall_s=rnd(time.perf_counter() - t0, 3))
        tok_s = s["decode_tok_s_per_seq_p50"]
        worker = self.engine  # the loaded model: exact shapes and dtypes of what a step reads
        ctx = (s["input_tokens"][0] if s["input_tokens"] else 0) + n / 2  # mean KV length over the steps
        b = decode_bytes(worker.model, batch=1, context=ctx, kv_dtype=self.engine.stats["kv_dtype"])
        s.update({"ms_per_token": rnd(1e3 / tok_s, 3) if tok_s else None,
                  "bytes_per_step": {k: int(v) for k, v in b.items()},
                  "achieved_gbs": rnd(b["total"] * tok_s / 1e9, 1) if tok_s else None})
        ceiling = (self.results.get("copy_bandwidth") or {}).get("ceiling_gbs")
        if ceiling and s["achieved_gbs"]:
            s["fraction_of_copy_bw"] = rnd(s["achieved_gbs"] / ceiling, 3)
        log(f"w1: {tok_s} tok/s ({s['ms_per_token']} ms/token), {s['achieved_gbs']} GB/s "
            f"({s.get('fraction_of_copy_bw')} of copy), ttft {s['ttft_ms_p50']} ms, {s['not_full_length']} short; "
            f"engine thread s {s['engine_host_s']} of {s['wall_s']}")
        out = {"summary": s, "requests": recs}
        if self.a.trace_dir:  # a window of pure batch-1 decode: every kernel in it belongs to a decode step
            out["trace"] = await self._guarded_trace(self._traced_decode(st))
        return out

    async def _guarded_trace(self, coro: Any) -> dict[str, Any]:
        try:
            return await coro
        except Exception as e:  # the trace is extra: keep the measured figures
            return {"error": repr(e), "traceback": traceback.format_exc()}

    async def _trace_window(self, name: str, seconds: float) -> dict[str, Any]:
        """Profile whatever the engine runs for `seconds` into trace_dir/name and summarize it."""
        import jax

        opts = jax.profiler.ProfileOptions()
        opts.python_tracer_level = 0  # tracing the engine thread's Python would distort the window
        opts.enable_hlo_proto = False  # keeps the file small
        where = str(Path(self.a.trace_dir) / name)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, lambda: jax.profiler.start_trace(where, profiler_options=opts))
        try:
            steps0, t0 = dict(self.engine.stats["steps"]), time.perf_counter()
            await asyncio.sleep(seconds)
            steps1, window = dict(self.engine.stats["steps"]), time.perf_counter() - t0
        finally:  # a session left open would make every later trace fail
            await loop.run_in_executor(None, jax.profiler.stop_trace)
        steps = {k: steps1[k] - steps0.get(k, 0) for k in steps1}
        out = {"dir": where, "window_s": rnd(window, 3), "engine_steps": steps, **summarize_trace(where, steps)}
        log(f"trace {name} idle gaps: {out.get('idle_gaps')}")
        log(f"trace {name}: {out.get('kernels_per_decode_step')} kernels/decode step, "
            f"{out.get('device_us_per_decode_step')} us device time/decode step, device busy "
            f"{out.get('device_busy_fraction')}, steps {steps} in {window:.2f} s")
        for f in out.get("kernel_families", []):
            log(f"  {f.get('us_per_iteration', f['time_us'])!s:>9} us {f.get('per_iteration', f['count'])!s:>7} x  "
                f"{f['name']}")
        return out

    async def _traced_decode(self, settings: dict[str, Any]) -> dict[str, Any]:
        st = await self.engine.query(self.images.new(), QUESTION, reasoning=False, stream=True, settings=settings)
        chunks = st.__aiter__()
        await chunks.__anext__()  # first answer text: the prefill is over, decode steps follow
        out = await self._trace_window("w1", min(0.5, self.a.trace_seconds))
        try:
            async for _ in chunks:
                pass
            await st.result()
        except Exception as e:  # keep the window's summary; say what broke after it
            out["error_after_window"] = repr(e)
        return out

    async def _closed_loop(self, c: int, images: list[np.ndarray], settings: dict[str, Any]
                           ) -> tuple[list[dict[str, Any]], float]:
        """c clients, each taking the next image until none is left."""
        recs: list[dict[str, Any]] = []
        it = iter(images)

        async def client() -> None:
            for img in it:
                recs.append(await one_request(self.engine, img, settings))

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(c)))
        wall = time.perf_counter() - t0
        for r in recs:
            r["t0"] -= t0
        return recs, wall

    @contextlib.contextmanager
    def _engine_thread(self) -> Iterator[dict[str, Any]]:
        """The engine thread over the block: its time by loop phase (`engine_host_s`, seconds;
        wait_outputs: blocked on the device, the rest is host work the device must hide) and, with
        --host-profile, a sample of its Python stack (`host_profile`) and of the vision thread's
        where the engine has one (`vision_thread_profile`: it shares the GIL and the device with
        the engine thread), filled in on exit."""
        host0 = dict(self.engine.stats["host_s"])
        out: dict[str, Any] = {}
        samplers: dict[str, Any] = {}
        if self.a.host_profile:
            from tools.host_sampler import ThreadSampler

            # a multi-device engine: the first device's threads (the others run alike)
            worker = getattr(self.engine._worker, "workers", [self.engine._worker])[0]
            samplers["host_profile"] = ThreadSampler(worker._thread)
            if worker._ahead is not None:
                samplers["vision_thread_profile"] = ThreadSampler(worker._ahead._thread)
        with contextlib.ExitStack() as stack:
            for sampler in samplers.values():
                stack.enter_context(sampler)
            yield out
        # microseconds kept: a CPU smoke run's launches take well under a millisecond
        out["engine_host_s"] = {k: rnd(v - host0.get(k, 0.0), 6) for k, v in self.engine.stats["host_s"].items()}
        for key, sampler in samplers.items():
            prof = out[key] = sampler.summary()
            log(f"{'vision' if key.startswith('vision') else 'engine'} thread samples ({sampler.samples}): "
                f"innermost in package {prof['innermost_in_package'][:12]}; innermost {prof['innermost'][:12]}")

    async def _level(self, c: int, n: int, max_tokens: int) -> dict[str, Any]:
        st = self.settings(max_tokens)
        if self.a.warmup:  # one untimed burst: the decode/prefill mix this level will run
            await asyncio.gather(*(one_request(self.engine, self.images.new(), st) for _ in range(c)))
        images = [self.images.new() for _ in range(n)]
        before = sched_stats(self.engine)
        enc0 = dict((self.engine.stats.get("encode_ahead") or {}).get("calls_by_images", {}))
        early0 = self.engine.stats.get("admitted_before_wait", 0)
        with self._engine_thread() as host:
            recs, wall = await self._closed_loop(c, images, st)
        s = summarize(recs, max_tokens)
        out_tok = sum(r["output_tokens"] for r in recs)
        s.update({"concurrency": c, "wall_s": rnd(wall, 3), "requests_per_s": rnd(len(recs) / wall, 3),
                  "output_tok_s": rnd(out_tok / wall, 1), "scheduler": sched_delta(before, sched_stats(self.engine))},
                 **host)
        s["launch_ms_per_step"] = launch_ms_per_step(s.get("engine_host_s", {}), s["scheduler"])
        enc1 = (self.engine.stats.get("encode_ahead") or {}).get("calls_by_images", {})
        s["vision_calls_by_images"] = {k: v - enc0.get(k, 0) for k, v in enc1.items() if v != enc0.get(k, 0)}
        s["admitted_before_wait"] = self.engine.stats.get("admitted_before_wait", 0) - early0  # EngineConfig's
        if s["cached_tokens_max"]:
            log(f"WARNING: prefix-cache hits in a fresh-image workload (cached_tokens up to {s['cached_tokens_max']})")
        return {"summary": s, "requests": recs}

    async def w2(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for c in self.a.concurrency:
            r = await self._level(c, c * self.a.requests_per_client, self.a.max_tokens)
            s = r["summary"]
            log(f"w2 C={c}: {s['requests_per_s']} req/s, {s['output_tok_s']} output tok/s, ttft p50/p90 "
                f"{s['ttft_ms_p50']}/{s['ttft_ms_p90']} ms, decode/seq {s['decode_tok_s_per_seq_p50']} tok/s, "
                f"batch {s['scheduler'].get('mean_decode_batch')}, cached max {s['cached_tokens_max']}; engine thread "
                f"s {s['engine_host_s']} of {s['wall_s']}; launch ms per step {s['launch_ms_per_step']}; vision calls "
                f"by images {s['vision_calls_by_images']}; admitted before the wait {s['admitted_before_wait']}")
            out[str(c)] = r
            self.results["w2"] = out
            self.dump()
        if self.a.trace_dir:
            out["trace"] = await self._guarded_trace(self._traced_load(max(self.a.concurrency)))
        return out

    async def _traced_load(self, c: int) -> dict[str, Any]:
        """c clients sending back to back; the trace starts once all of them are in flight."""
        st = self.settings(self.a.max_tokens)
        stop = False

        async def client() -> None:
            while not stop:
                await one_request(self.engine, self.images.new(), st)

        tasks = [asyncio.create_task(client()) for _ in range(c)]
        try:
            await asyncio.sleep(min(2.0, self.a.trace_seconds))
            out = await self._trace_window("w2", self.a.trace_seconds)
        finally:
            stop = True
            await asyncio.gather(*tasks)
        return {"concurrency": c, **out}

    async def w3(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for c in self.a.w3_concurrency:
            r = await self._level(c, self.a.w3_requests, self.a.w3_tokens)
            s = r["summary"]
            log(f"w3 C={c}: {s['n']} req, {s['requests_per_s']} req/s, latency p50/p99 {s['latency_ms_p50']}/"
                f"{s['latency_ms_p99']} ms, ttft p50 {s['ttft_ms_p50']} ms")
            out[str(c)] = r
        return out

    async def w4(self) -> dict[str, Any]:
        from kestrel_jax.models.image_crops import image_tiling

        st = self.settings(self.a.w3_tokens)  # TTFT does not depend on the answer length
        out: dict[str, Any] = {}
        for spec in self.a.w4_images:
            h, w = parse_hw(spec)
            tiling = image_tiling(h, w, self.engine.cfg.vision)
            for _ in range(self.a.warmup):
                await one_request(self.engine, self.images.new(h, w), st)
            cold, warm = [], []
            for _ in range(self.a.w4_reps):
                img = self.images.new(h, w)
                cold.append(await one_request(self.engine, img, st, stream=True))
                warm.append(await one_request(self.engine, img, st, stream=True))  # prefix-cache hit
            sc, sw = summarize(cold, st["max_tokens"]), summarize(warm, st["max_tokens"])
            sw["cached_tokens_min"] = min(r["cached_tokens"] for r in warm)
            out[spec] = {"crops": tiling[0] * tiling[1] + 1, "tiling": list(tiling), "cold": sc, "warm": sw,
                         "requests": {"cold": cold, "warm": warm}}
            log(f"w4 {spec} ({out[spec]['crops']} crops): ttft cold {sc['ttft_ms_p50']} ms "
                f"(client {sc['client_ttft_ms_p50']}), warm {sw['ttft_ms_p50']} ms, "
                f"cached {sw['cached_tokens_min']}..{sw['cached_tokens_max']}")
        return out


# ---------------------------------------------------------------------------------- trace
def summarize_trace(trace_dir: str, steps: dict[str, int]) -> dict[str, Any]:
    """From the newest .xplane.pb under trace_dir: device events (GPU kernels and copies; on CPU,
    XLA thunks) per engine step and per decode-module run, device busy fraction (union of event
    intervals over their span), and the costliest kernels. Module runs come from `run_id` stats
    where the events carry them (kernels replayed from a command buffer may carry none)."""
    from jax.profiler import ProfileData

    files = sorted(Path(trace_dir).rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not files:
        return {"error": f"no .xplane.pb under {trace_dir}"}
    data = ProfileData.from_file(str(files[-1]))
    gpu = [p for p in data.planes if p.name.startswith("/device:GPU")]
    mods: dict[str, dict[str, Any]] = defaultdict(lambda: {"events": 0, "time_us": 0.0, "runs": set()})
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    by_module: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])  # (module, family)
    spans: list[tuple[int, int]] = []
    names: dict[tuple[int, int], str] = {}
    modules: dict[tuple[int, int], str] = {}  # each event's XLA module ("None": copies, memsets)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # jaxlib's event_stats type, harmless
        for plane in gpu or [p for p in data.planes if p.name == "/host:CPU"]:
            for line in plane.lines:
                if any(s in line.name for s in ("XLA Modules", "XLA Ops", "Steps", "Framework", "Source")):
                    continue  # derived timelines, not device work
                for ev in line.events:
                    stats = dict(ev.stats)
                    if "hlo_module" not in stats and not gpu:
                        continue  # host threads: only XLA thunks are device work
                    m = mods[str(stats.get("hlo_module"))]
                    m["events"] += 1
                    m["time_us"] += ev.duration_ns / 1e3
                    if "run_id" in stats:
                        m["runs"].add(stats["run_id"])
                    k = by_name[ev.name[:100]]
                    k[0] += 1
                    k[1] += ev.duration_ns / 1e3
                    km = by_module[(str(stats.get("hlo_module")), _family(ev.name[:100]))]
                    km[0] += 1
                    km[1] += ev.duration_ns / 1e3
                    spans.append((ev.start_ns, ev.end_ns))
                    names[(ev.start_ns, ev.end_ns)] = ev.name[:100]
                    modules[(ev.start_ns, ev.end_ns)] = str(stats.get("hlo_module"))
    out: dict[str, Any] = {"file": str(files[-1]), "file_bytes": files[-1].stat().st_size, "events": len(spans),
                           "device_planes": [p.name for p in gpu]}
    busy = 0
    if spans:
        spans.sort()
        start, (cur_s, cur_e) = spans[0][0], spans[0]
        for s0, e0 in spans[1:]:
            if s0 > cur_e:
                busy, cur_s, cur_e = busy + cur_e - cur_s, s0, e0
            else:
                cur_e = max(cur_e, e0)
        busy += cur_e - cur_s
        out["device_busy_fraction"] = rnd(busy / max(1, cur_e - start), 3)
        out["idle_gaps"] = idle_gaps(spans, names, modules)
        if gpu:
            out["engine_thread_in_long_gaps"] = engine_thread_in_gaps(data, long_gaps(spans))
            out["command_buffer_updates"] = command_buffer_updates(data)
            out["graph_launch_gaps"] = graph_launch_gaps(data)
    n_steps = steps.get("decode", 0) + steps.get("prefill", 0)
    if n_steps:
        out["events_per_step"] = rnd(len(spans) / n_steps, 1)
        out["device_busy_us_per_step"] = rnd(busy / 1e3 / n_steps, 1)
    dec = [v for k, v in mods.items() if "decode" in k]
    runs = sum(len(v["runs"]) for v in dec)
    if dec and runs:
        out["decode_module_events_per_run"] = rnd(sum(v["events"] for v in dec) / runs, 1)
        out["decode_module_us_per_run"] = rnd(sum(v["time_us"] for v in dec) / runs, 1)
    if steps.get("decode") and not steps.get("prefill"):  # a pure decode window: every event is decode work
        out["kernels_per_decode_step"] = out["events_per_step"]
        out["device_us_per_decode_step"] = out["device_busy_us_per_step"]
    elif "decode_module_events_per_run" in out:
        out["kernels_per_decode_step"] = out["decode_module_events_per_run"]
        out["device_us_per_decode_step"] = out["decode_module_us_per_run"]
    out["modules"] = {k: {"events": v["events"], "time_us": rnd(v["time_us"], 1), "runs": len(v["runs"])}
                      for k, v in sorted(mods.items(), key=lambda kv: -kv[1]["time_us"])[:10]}
    out["top_kernels"] = [{"name": k, "count": int(v[0]), "time_us": rnd(v[1], 1)}
                          for k, v in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:15]]
    # Families: names with XLA's numeric suffix dropped (gemm_fusion_dot_133 -> gemm_fusion_dot),
    # per decode iteration where the window is pure decode, so the whole step reads as one table.
    fam: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for kname, (kcount, ktime) in by_name.items():
        tot = fam[_family(kname)]
        tot[0] += kcount
        tot[1] += ktime
    iters = steps.get("decode_iterations") or steps.get("decode", 0)
    per = iters if iters and not steps.get("prefill") else 0
    out["kernels"] = [{"name": k, "count": int(v[0]), "time_us": rnd(v[1], 1)}
                      for k, v in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:400]]
    out["kernel_families"] = [
        {"name": k, "count": int(v[0]), "time_us": rnd(v[1], 1),
         **({"per_iteration": rnd(v[0] / per, 2), "us_per_iteration": rnd(v[1] / per, 2)} if per else {})}
        for k, v in sorted(fam.items(), key=lambda kv: -kv[1][1])[:60]]
    # Mixed windows (prefill, vision and decode steps): the families of each module's kernels.
    out["module_families"] = {
        mod: [{"name": f, "count": int(v[0]), "time_us": rnd(v[1], 1)}
              for (m2, f), v in sorted(by_module.items(), key=lambda kv: -kv[1][1]) if m2 == mod][:30]
        for mod in out["modules"]}
    return out


def idle_gaps(spans: list[tuple[int, int]], names: dict[tuple[int, int], str],
              modules: dict[tuple[int, int], str] | None = None) -> dict[str, Any]:
    """Where the device idles (`spans` sorted): idle time and count by gap length, and the kernel
    families that end and follow the longest gaps. Many short gaps between kernels mean the host
    launches them too slowly; a few long ones, that the device waits between steps. With
    `modules` (each span's XLA module), gaps of 1 ms or more also by the modules around them: the
    same module on both sides means the device waited inside a step (or between two runs of it)."""
    edges = ((2, "<2us"), (10, "<10us"), (50, "<50us"), (200, "<200us"), (1000, "<1000us"), (float("inf"), ">=1000us"))
    by_len = {label: [0, 0.0] for _, label in edges}
    around: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    long_modules: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    before: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])  # family: kernels, gaps, idle us
    end, last = spans[0][1], spans[0]
    for span in spans[1:]:
        gap = (span[0] - end) / 1e3
        nxt = before[_family(names.get(span, "?"))]
        nxt[0] += 1
        if gap > 0:
            key = next(label for edge, label in edges if gap < edge)
            by_len[key][0] += 1
            by_len[key][1] += gap
            if gap >= 10:
                a = around[f"{_family(names.get(last, '?'))} -> {_family(names.get(span, '?'))}"]
                a[0] += 1
                a[1] += gap
                if gap >= 1000 and modules is not None:
                    m = long_modules[f"{modules.get(last, '?')} -> {modules.get(span, '?')}"]
                    m[0] += 1
                    m[1] += gap
            else:
                nxt[1] += 1
                nxt[2] += gap
        if span[1] > end:
            end, last = span[1], span
    return {"by_length": {k: {"count": int(v[0]), "idle_us": rnd(v[1], 1)} for k, v in by_len.items()},
            "longest_after_before": [{"between": k, "count": int(v[0]), "idle_us": rnd(v[1], 1)}
                                     for k, v in sorted(around.items(), key=lambda kv: -kv[1][1])[:12]],
            # gaps under 10 us by the kernel family that follows them: spread evenly, or bunched
            "short_before": [{"family": k, "kernels": int(v[0]), "gaps": int(v[1]), "idle_us": rnd(v[2], 1)}
                             for k, v in sorted(before.items(), key=lambda kv: -kv[1][2])[:15]],
            **({"long_by_module": [{"between": k, "count": int(v[0]), "idle_us": rnd(v[1], 1)}
                                   for k, v in sorted(long_modules.items(), key=lambda kv: -kv[1][1])[:12]]}
               if modules is not None else {})}


def long_gaps(spans: list[tuple[int, int]], min_ns: int = 1_000_000) -> list[tuple[int, int]]:
    """The device's idle intervals of at least `min_ns` between `spans` (sorted by start)."""
    out: list[tuple[int, int]] = []
    end = spans[0][1]
    for s0, e0 in spans[1:]:
        if s0 - end >= min_ns:
            out.append((end, s0))
        end = max(end, e0)
    return out


def engine_thread_in_gaps(data: Any, gaps: list[tuple[int, int]]) -> dict[str, Any]:
    """What the engine thread did while the device idled in `gaps`: the host trace line that holds
    the engine's `kestrel_jax.*` ranges (stepper.py), its events' overlap with the gaps by name
    (nested events each count: read it as a profile's inclusive times), and the gap time covered by
    none of them (Python between ranges: scheduling, bookkeeping, or waiting for the GIL)."""
    total = sum(e - s for s, e in gaps)
    best: Any = None
    for plane in data.planes:
        if not plane.name.startswith("/host"):
            continue
        for line in plane.lines:
            evs = [(ev.start_ns, ev.end_ns, ev.name) for ev in line.events]
            n = sum(name.startswith("kestrel_jax.") for _, _, name in evs)
            if n and (best is None or n > best[0]):
                best = (n, line.name, evs)
    if best is None:
        return {"gaps": len(gaps), "idle_us": rnd(total / 1e3, 1), "error": "no kestrel_jax ranges in the trace"}
    _, line_name, evs = best
    by_name: dict[str, float] = defaultdict(float)
    covered = 0
    for g0, g1 in gaps:
        ivs = []
        for s0, e0, name in evs:
            lo, hi = max(s0, g0), min(e0, g1)
            if hi > lo:
                by_name[name[:80]] += hi - lo
                ivs.append((lo, hi))
        ivs.sort()
        cur = g0
        for lo, hi in ivs:  # union of the events' overlaps
            if hi > cur:
                covered += hi - max(lo, cur)
                cur = hi
    return {"line": line_name, "gaps": len(gaps), "idle_us": rnd(total / 1e3, 1),
            "outside_any_event_us": rnd((total - covered) / 1e3, 1),
            "by_event": [{"name": k, "us": rnd(v / 1e3, 1)} for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])
                         [:25]]}


CB_EVENTS = ("command_buffer::update", "command_buffer::initialize")


def command_buffer_updates(data: Any) -> list[dict[str, Any]]:
    """XLA's command-buffer (CUDA graph) updates and initializations on the host threads, by thread,
    XLA module (the enclosing `<module>:XLA GPU module` range) and graph size (`num_commands`):
    count, total and mean host us, costliest first. An update re-records the graph nodes whose
    buffers moved since the last call; an initialization records and instantiates a new graph."""
    agg: dict[tuple[str, str, str, Any], list[float]] = defaultdict(lambda: [0, 0.0])
    for plane in data.planes:
        if not plane.name.startswith("/host"):
            continue
        for line in plane.lines:
            evs = list(line.events)
            mods = sorted((ev.start_ns, ev.end_ns, ev.name.split(":")[0]) for ev in evs
                          if ev.name.endswith("XLA GPU module"))
            for ev in evs:
                kind = next((k for k in CB_EVENTS if ev.name.startswith(k)), None)
                if kind is None:
                    continue
                module = next((m for s0, e0, m in mods if s0 <= ev.start_ns <= e0), "?")
                stats = dict(getattr(ev, "stats", None) or [])
                a = agg[(line.name, module, kind.split("::")[1], stats.get("num_commands"))]
                a[0] += 1
                a[1] += (ev.end_ns - ev.start_ns) / 1e3
    rows = [{"thread": t, "module": m, "kind": k, "num_commands": c, "count": int(n), "us": rnd(us, 1),
             "us_each": rnd(us / n, 1)} for (t, m, k, c), (n, us) in agg.items()]
    return sorted(rows, key=lambda r: -r["us"])[:20]


def graph_launch_gaps(data: Any, min_pairs: int = 100) -> list[dict[str, Any]]:
    """Kernel-to-kernel launch gaps inside each CUDA graph on the GPU planes: for every graph id with
    at least `min_pairs` consecutive kernel pairs on one stream, the pairs, the median and mean gap
    (us; negative: the next kernel started over the previous one's tail) and the fraction of pairs
    that overlap, most pairs first. The H100's two batch-1 decode speeds (BENCHMARKS.md, sessions 14-16
    and 63) run one graph of the same executable with ~0.45 us between its kernels at the slow level
    and ~0.03 us, a third of them overlapping, at the fast one."""
    pairs: dict[Any, list[float]] = defaultdict(list)
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            evs = sorted((ev.start_ns, ev.end_ns, dict(getattr(ev, "stats", None) or []).get("cuda_graph_id"))
                         for ev in line.events)
            for (_, e0, g0), (s1, _, g1) in zip(evs, evs[1:], strict=False):
                if g0 is not None and g0 == g1:
                    pairs[(plane.name, g0)].append((s1 - e0) / 1e3)
    rows = []
    for (_, graph), gaps in sorted(pairs.items(), key=lambda kv: -len(kv[1])):
        if len(gaps) < min_pairs:
            continue
        arr = np.asarray(gaps)
        rows.append({"graph": graph, "pairs": len(gaps), "median_gap_us": rnd(float(np.median(arr)), 3),
                     "mean_gap_us": rnd(float(arr.mean()), 3), "overlap_fraction": rnd(float((arr < 0).mean()), 3)})
    return rows[:5]


def _family(kernel: str) -> str:
    """A kernel name without XLA's numeric suffix (gemm_fusion_dot_133 -> gemm_fusion_dot)."""
    return re.sub(r"[._]\d+$", "", kernel)


# ---------------------------------------------------------------------------------- comparison
def headline(res: dict[str, Any]) -> dict[str, float | None]:
    """Our figures that Kestrel's harness also reports."""
    def get(*keys: str) -> Any:
        x: Any = res
        for k in keys:
            x = x.get(k) if isinstance(x, dict) else None
        return x

    h: dict[str, float | None] = {"decode_tok_s_b1": get("w1", "summary", "decode_tok_s_per_seq_p50"),
                                  "ttft_ms_378": get("w4", "378x378", "cold", "ttft_ms_p50"),
                                  "ttft_ms_756": get("w4", "756x756", "cold", "ttft_ms_p50")}
    for c in ("8", "32", "64"):
        h[f"req_s_c{c}"] = get("w2", c, "summary", "requests_per_s")
        h[f"out_tok_s_c{c}"] = get("w2", c, "summary", "output_tok_s")
        h[f"ttft_ms_p50_c{c}"] = get("w2", c, "summary", "ttft_ms_p50")
    return h


def peer_headline(res: dict[str, Any]) -> dict[str, float | None]:
    """The same figures from a bench_kestrel.py JSON (full, or the compact per-run summaries)."""
    def summ(x: Any) -> dict[str, Any]:
        return (x.get("summary", x) if isinstance(x, dict) else None) or {}

    single, conc = res.get("single", {}), res.get("concurrency", {})
    h: dict[str, float | None] = {"decode_tok_s_b1": summ(single.get("378")).get("decode_tok_s_per_seq_p50"),
                                  "ttft_ms_378": summ(single.get("378")).get("ttft_ms_p50"),
                                  "ttft_ms_756": summ(single.get("756")).get("ttft_ms_p50")}
    for c in ("8", "32", "64"):
        s = summ(conc.get(c))
        h[f"req_s_c{c}"], h[f"out_tok_s_c{c}"] = s.get("requests_per_s"), s.get("output_tok_s")
        h[f"ttft_ms_p50_c{c}"] = s.get("ttft_ms_p50")
    return h


ROWS = [("decode_tok_s_b1", "batch-1 decode tok/s", True), ("ttft_ms_378", "TTFT 378 px ms", False),
        ("ttft_ms_756", "TTFT 756 px ms", False), ("req_s_c64", "C=64 req/s", True),
        ("out_tok_s_c64", "C=64 output tok/s", True), ("ttft_ms_p50_c64", "C=64 TTFT p50 ms", False),
        ("req_s_c8", "C=8 req/s", True), ("req_s_c32", "C=32 req/s", True)]


def ratio_table(ours: dict[str, dict[str, Any]], peer: dict[str, dict[str, Any]], label: str) -> tuple[str, dict]:
    """Markdown table ours / Kestrel per model; `ours`/`peer` map md3/md2 to result JSONs."""
    lines = [f"| model | metric | ours | Kestrel ({label}) | ours/Kestrel | better |", "|---|---|---|---|---|---|"]
    table: dict[str, Any] = {}
    for m in sorted(ours, reverse=True):  # md3 first
        ho, hp = headline(ours[m]), peer_headline(peer.get(m, {}))
        for key, name, higher in ROWS:
            o, p = ho.get(key), hp.get(key)
            ratio = rnd(o / p, 3) if o and p else None
            better = None if ratio is None else ("ours" if (ratio > 1) == higher else "Kestrel")
            table.setdefault(m, {})[key] = {"ours": o, "kestrel": p, "ratio": ratio}
            lines.append(f"| {m} | {name} | {o} | {p} | {ratio} | {better or '-'} |")
    return "\n".join(lines), table


def read_json(path: str | Path) -> Any:
    """A result JSON; gzipped when its name ends in .gz (the benchmark logs are kept that way)."""
    p = Path(path)
    raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
    return json.loads(raw)


def write_json(path: str | Path, obj: Any) -> None:
    """`obj` as indented JSON at `path` (gzipped when the name ends in .gz), replaced atomically."""
    p = Path(path)
    text = (json.dumps(obj, indent=1, default=str) + "\n").encode()
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_bytes(gzip.compress(text, mtime=0) if p.suffix == ".gz" else text)
    tmp.replace(p)


def compare_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="benchmark.py compare", description="ours / Kestrel ratio table")
    ap.add_argument("--ours", nargs="*", default=[], help="our result JSONs (model taken from the file)")
    ap.add_argument("--peer", nargs="*", default=[], help="bench_kestrel.py JSONs from the same run")
    ap.add_argument("--ref", default=None, help="peer results/*.json (compact, other run): used for models "
                                                "with no side-by-side peer JSON")
    ap.add_argument("--ref-run", default="run2")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    def load(paths: list[str], names: Callable[[str], str]) -> dict[str, dict[str, Any]]:
        got = {}
        for p in paths:
            try:
                d = read_json(p)
                got[names(d.get("model", ""))] = d
            except (OSError, ValueError) as e:
                print(f"skipping {p}: {e}")
        return got

    ours = load(a.ours, lambda m: m)
    peer = load(a.peer, lambda m: PEER_NAMES.get(m, m))
    both = {m: ours[m] for m in ours if m in peer}
    out: dict[str, Any] = {}
    if both:
        text, out["same_run"] = ratio_table(both, peer, "same run")
        print(text)
    missing = {m: ours[m] for m in ours if m not in peer}
    if missing and a.ref and Path(a.ref).exists():
        runs = read_json(a.ref)["runs"][a.ref_run]
        ref = {m: runs[m] for m in missing if m in runs}
        text, out["reference"] = ratio_table(missing, ref, f"reference {a.ref_run}, other machine")
        print("\nNo side-by-side Kestrel run for " + ", ".join(missing) + "; against the stored reference:")
        print(text)
    if a.out:
        write_json(a.out, out)
    return 0


# ---------------------------------------------------------------------------------- main
def final_table(res: dict[str, Any]) -> str:
    """Markdown summary for BENCHMARKS.md."""
    dev = res.get("device") or {}
    rows = [f"### {res.get('model')} on {dev.get('kind')} (jax {(res.get('versions') or {}).get('jax')})", "",
            "| workload | figure | value |", "|---|---|---|"]

    def add(w: str, name: str, *vals: Any, sep: str = " / ") -> None:
        if any(v not in (None, "") for v in vals):
            rows.append(f"| {w} | {name} | {sep.join(str(v) for v in vals)} |")

    w1 = (res.get("w1") or {}).get("summary", {})
    add("w1", "batch-1 decode tok/s, ms/token", w1.get("decode_tok_s_per_seq_p50"), w1.get("ms_per_token"))
    add("w1", "achieved GB/s, fraction of copy GB/s", w1.get("achieved_gbs"), w1.get("fraction_of_copy_bw"))
    add("w1", "copy GB/s (read + write)", (res.get("copy_bandwidth") or {}).get("ceiling_gbs"))
    for w in ("w1", "w2"):
        tr = (res.get(w) or {}).get("trace") or {}
        add(w, "trace: kernels / device us per decode step, busy", tr.get("kernels_per_decode_step"),
            tr.get("device_us_per_decode_step"), tr.get("device_busy_fraction"))
    for c, lv in (res.get("w2") or {}).items():
        if not c.isdigit():
            continue  # the trace
        s = lv.get("summary", {})
        add("w2", f"C={c} req/s, output tok/s, TTFT p50/p90 ms", s.get("requests_per_s"), s.get("output_tok_s"),
            f"{s.get('ttft_ms_p50')}/{s.get('ttft_ms_p90')}", sep=", ")
    for c, lv in (res.get("w3") or {}).items():
        s = lv.get("summary", {})
        add("w3", f"C={c} req/s, latency p50/p99 ms", s.get("requests_per_s"),
            f"{s.get('latency_ms_p50')}/{s.get('latency_ms_p99')}", sep=", ")
    for spec, v in (res.get("w4") or {}).items():
        add("w4", f"TTFT {spec} ({v['crops']} crops) cold / warm ms", v["cold"]["ttft_ms_p50"],
            v["warm"]["ttft_ms_p50"])
    for st in res.get("startup", []):
        add("startup", f"create s ({st.get('cache_state')} compile cache), of which load s", st.get("create_s"),
            st.get("load_s"))
    add("note", "ran meanwhile", (res.get("env") or {}).get("KJX_BENCH_NOTE"))
    ck = res.get("checkpoint") or {}
    add("checkpoint", "synthetic write s" + (" (earlier run)" if ck.get("reused") else ""), ck.get("write_s"))
    for k, v in {**(res.get("errors") or {}), **(res.get("skipped") or {})}.items():
        rows.append(f"| {k} | not measured | {str(v)[:100]} |")
    return "\n".join(rows)


def resolve_sizes(a: argparse.Namespace) -> None:
    for key, (full, quick) in SIZES.items():
        if getattr(a, key) is None:
            setattr(a, key, quick if a.quick else full)
    if a.concurrency is None:
        a.concurrency = [2] if a.quick else [8, 32, 64]


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, choices=sorted(MODELS))
    ap.add_argument("--checkpoint", default=None, help="reuse (or write, then keep) a synthetic checkpoint here")
    ap.add_argument("--prepare-only", action="store_true", help="write the checkpoint if missing, then exit")
    ap.add_argument("--random-weights", action="store_true",
                    help="make random weights on the device instead of a checkpoint (no load time measured)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {','.join(WORKLOADS)}")
    ap.add_argument("--concurrency", type=int, nargs="+", default=None, help="w2 levels (default 8 32 64)")
    ap.add_argument("--out", default=None, help="result JSON (gzipped when the name ends in .gz)")
    ap.add_argument("--append", action="store_true", help="add this run's startup record to an existing --out")
    ap.add_argument("--host-profile", action="store_true",
                    help="sample the engine thread's Python stack during w1 and each w2 level (tools/host_sampler.py)")
    ap.add_argument("--trace-dir", default=None, help="profile a w1 and a w2 window into DIR/w1, DIR/w2")
    ap.add_argument("--compile-cache", default=None, help="persistent compilation cache directory")
    ap.add_argument("--quick", action="store_true", help="tiny request counts (CPU smoke test)")
    ap.add_argument("--engine-args", nargs="*", default=[], help="EngineConfig overrides KEY=VALUE, runner.KEY=VALUE")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="seconds from the start: later workloads are skipped, a running one is cut")
    ap.add_argument("--seed", type=int, default=1234)
    for key in SIZES:
        kind = str if key == "w4_images" else float if key == "trace_seconds" else int
        multi = isinstance(SIZES[key][0], list)
        ap.add_argument("--" + key.replace("_", "-"), type=kind, nargs="+" if multi else None, default=None,
                        help=f"default {SIZES[key][0]} (quick {SIZES[key][1]})")
    a = ap.parse_args(argv)
    if a.prepare_only and not a.checkpoint:
        ap.error("--prepare-only needs --checkpoint (where to keep it)")
    resolve_sizes(a)
    a.workloads = [w.strip() for w in a.workloads.split(",") if w.strip()]
    bad = set(a.workloads) - set(WORKLOADS)
    if bad:
        ap.error(f"unknown workloads {sorted(bad)}")
    a.cache_entries = cache_entries(a.compile_cache)  # before this process compiles anything
    return a


class Output:
    """The result JSON, rewritten after every workload so a killed run keeps what it measured. With
    --append it adds this run's start-up record to an earlier run's file (warm-cache start-up is
    measured in a second process) and leaves the rest of that file alone."""

    def __init__(self, a: argparse.Namespace):
        self.path = Path(a.out) if a.out else None
        self.base = read_json(self.path) if a.append and self.path and self.path.exists() else None
        self.res: dict[str, Any] = {
            "model": a.model, "argv": sys.argv, "quick": a.quick, "errors": {}, "skipped": {},
            "settings": {"question": QUESTION, "reasoning": False, "temperature": 0.0, "top_p": 1.0,
                         "ignore_eos": True, "image": "new random RGB per request",
                         **{k: getattr(a, k) for k in (*SIZES, "concurrency", "workloads", "engine_args")}},
            # KJX_BENCH_NOTE: what else ran on the machine meanwhile (tools/gpu_run.sh sets it)
            "env": {k: os.environ.get(k) for k in ("JAX_PLATFORMS", "XLA_PYTHON_CLIENT_PREALLOCATE",
                                                   "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_FLAGS", "KJX_BENCH_NOTE")}}

    def merged(self) -> dict[str, Any]:
        if self.base is None:
            return self.res
        out = dict(self.base)
        out["startup"] = [*self.base.get("startup", []), *self.res.get("startup", [])]
        out["errors"] = {**self.base.get("errors", {}), **{f"append:{k}": v for k, v in self.res["errors"].items()}}
        return out

    def dump(self) -> None:
        if self.path:
            write_json(self.path, self.merged())


async def run(a: argparse.Namespace, o: Output) -> int:
    import jax

    from kestrel_jax.serving.engine import InferenceEngine

    t_start = time.perf_counter()
    res = o.res
    model = None
    if a.random_weights:  # weights made on the device: no checkpoint to write or load
        import jax.numpy as jnp

        from kestrel_jax.models.moondream import random_model

        factory, kw = MODELS[a.model]
        t0 = time.perf_counter()
        model = random_model(factory(), dtype=jnp.bfloat16, fp8_experts=bool(kw.get("fp8_experts")),
                             kv_scale=0.05 if kw.get("kv_scales") else None)
        path, tmp = Path("random-weights"), None
        res["checkpoint"] = {"random_weights": True, "make_s": rnd(time.perf_counter() - t0), **kw}
    else:
        path, res["checkpoint"], tmp = prepare_checkpoint(a.model, a.checkpoint, seed=0)
    o.dump()
    if a.prepare_only:
        return 0
    try:
        cache = a.compile_cache
        entries = a.cache_entries  # counted by parse_args, before anything compiled (the random weights' programs)
        res["device"], res["versions"] = device_info(), versions()
        log(f"device {res['device']}; versions {res['versions']}")
        if a.workloads != ["startup"]:
            try:
                res["copy_bandwidth"] = copy_bandwidth(a.bandwidth_mib)
                log(f"copy bandwidth {res['copy_bandwidth']}")
            except Exception as e:
                res["errors"]["copy_bandwidth"] = repr(e)
        cfg = engine_config(str(path), a.engine_args, a.compile_cache)
        res["engine_config"] = config_dict(cfg)
        log(f"settings {res['settings']}; env {res['env']}")
        log(f"engine config {res['engine_config']}")
        state = "none" if not cache else ("warm" if entries else "cold")
        log(f"creating the engine (compile cache {state}, {entries} entries)")
        t0 = time.perf_counter()
        phases: dict[str, list[float]] = {}  # JAX's own compile-pipeline timings during start-up

        def on_duration(event: str, duration_secs: float, **kwargs: str | int) -> None:
            phases.setdefault(event, []).append(duration_secs)

        jax.monitoring.register_event_duration_secs_listener(on_duration)
        try:
            engine = await InferenceEngine.create(cfg, model=model)
        except Exception as e:
            res["errors"]["startup"] = repr(e)
            res["startup_traceback"] = traceback.format_exc()
            log(f"engine start failed: {e!r}")
            o.dump()
            return 2
        finally:
            jax.monitoring.unregister_event_duration_listener(on_duration)
        st = engine.stats
        res["startup"] = [{"create_s": rnd(time.perf_counter() - t0), "load_s": rnd(st.get("load_s")),
                           "startup_s": rnd(st.get("startup_s")), "cache_state": state,
                           "cache_entries_before": entries, "cache_dir": cache,
                           # seconds per compile phase, summed over every jit (tracing, lowering to
                           # StableHLO, XLA compile or cache load), and each step variant's warm-up
                           "phases_s": {k.rsplit("/", 1)[-1]: [len(v), rnd(sum(v))] for k, v in sorted(phases.items())
                                        if k.startswith("/jax/")},
                           "variants_s": st.get("compile_s"), "compile_threads": st.get("compile_threads"),
                           "export_steps": st.get("export")}]  # lowered steps loaded / exported / fallback
        res["engine_stats"] = {k: st[k] for k in ("num_pages", "page_size", "kv_dtype")}
        log(f"engine ready: {res['startup'][0]}; {res['engine_stats']}")
        o.dump()
        bench = Bench(engine, a, res, o.dump)
        try:
            for name in WORKLOADS[1:]:
                if name not in a.workloads:
                    continue
                left = None if a.time_budget_s is None else a.time_budget_s - (time.perf_counter() - t_start)
                if left is not None and left < (2.0 if a.quick else MIN_WORKLOAD_S):
                    res["skipped"][name] = f"time budget ({left:.0f} s left)"
                    log(f"skipping {name}: {left:.0f} s left")
                    continue
                log(f"{name} start")
                try:
                    res[name] = await asyncio.wait_for(getattr(bench, name)(), timeout=left)
                except Exception as e:  # TimeoutError included: record it, go on with the next one
                    res["errors"][name] = repr(e)
                    res.setdefault("tracebacks", {})[name] = traceback.format_exc()
                    log(f"{name} failed: {e!r}")
                o.dump()
        finally:
            try:
                await asyncio.wait_for(engine.shutdown(), timeout=60)
            except Exception as e:
                log(f"shutdown: {e!r}")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    res["headline"] = headline(res)
    res["total_s"] = rnd(time.perf_counter() - t_start)
    o.dump()
    print("\n" + final_table(o.merged()) + "\n", flush=True)
    return 1 if res["errors"] else 0


def cache_entries(cache: str | None) -> int:
    """Files in the persistent compile cache `cache` (0 where there is none): whether start-up finds
    it warm. Counted before the first compile of the process: `--random-weights` builds its model
    with jitted programs that the cache stores too, which made a fresh cache look warm
    (fifty-sixth session: "warm, 211 entries" on a first run, start-up 99.9 s)."""
    return sum(1 for f in Path(cache).rglob("*") if f.is_file()) if cache and Path(cache).exists() else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compare"]:
        return compare_main(argv[1:])
    a = parse_args(argv)
    if a.append:
        a.workloads = ["startup"]
    if a.compile_cache and not a.prepare_only:
        # Set before anything compiles: JAX decides once, at the first compile, whether the
        # persistent cache is used, so leaving it to the runner would be too late.
        import jax

        os.makedirs(a.compile_cache, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", a.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return asyncio.run(run(a, Output(a)))


if __name__ == "__main__":
    raise SystemExit(main())
