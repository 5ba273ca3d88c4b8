#!/usr/bin/env python3
"""Where one engine step's device time goes, kernel by kernel (GPU): the runner's prefill, mixed
or decode step at production size (random weights), timed with CUPTI per kernel (median over
iterations), grouped into kernel families, with the step's optimized HLO written beside it so
that fusion names map to the ops they run. The W2 traces show which steps matter (prefill and
mixed steps of ~1,500 tokens, decode at batch 64); this says what inside them costs.

  PYTHONPATH=. python3 tools/probe_step_kernels.py --model md3 --kinds prefill,mixed,decode --out-dir $OUT
  PYTHONPATH=. python3 tools/probe_step_kernels.py --model md3 --tiny --kinds prefill   # CPU smoke run
  PYTHONPATH=. python3 tools/probe_step_kernels.py --kinds decode --batch 1 --ab KESTREL_JAX_TAU_DOTS=0,1
  PYTHONPATH=. python3 tools/probe_step_kernels.py --kinds decode --batch 1 \
      --sets default KESTREL_JAX_MERGED_PROJ=1 KESTREL_JAX_MERGED_PROJ=1+KESTREL_JAX_L2_PREFETCH=30

With --ab, one process compiles the step once per value of a switch and measures the variants in
turn (A B A B ...): one model build and one machine for the comparison, drift shared alike;
--sets does the same for variants of several switches each.
Beside the CUPTI sum each step gets a host-timed wall clock per blocking call (--wall-rounds, in
turn as well): a change can move the wall time by more than the kernel sum (the twenty-first
session's region heads: the sum -1 us, W1's time per token -30 us), and the wall time is what W1
sees. It includes the probe's undonated KV-pool copy and the dispatch, alike for every variant.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel_jax.models.config import md2_config, md3_config, tiny_config  # noqa: E402
from kestrel_jax.models.moondream import MoondreamModel, random_model  # noqa: E402
from kestrel_jax.models.vision import tile_pool_matrices  # noqa: E402
from kestrel_jax.pallas import ops  # noqa: E402
from kestrel_jax.serving import batch as bt  # noqa: E402
from kestrel_jax.serving.runner import Runner, RunnerConfig, put_host_arrays  # noqa: E402
from tools.diff_step_kernels import diff as diff_steps  # noqa: E402


def synthetic_model(name: Literal["md2", "md3"], *, tiny: bool = False, seed: int = 3,
                    layers: int | None = None) -> MoondreamModel:
    """The probes' random-weight models: the tests' tiny config in float32 (a CPU smoke run), or the
    full-size model as the benchmarks serve it (MD3: FP8 experts and FP8 KV scales). `layers`: only
    the text decoder's first that many layers (MD3's first four are its dense ones)."""
    cfg = tiny_config(name) if tiny else md3_config() if name == "md3" else md2_config()
    if layers is not None:
        t = cfg.text
        moe = None if t.moe is None else dataclasses.replace(t.moe, start_layer=min(t.moe.start_layer, layers))
        cfg = dataclasses.replace(cfg, text=dataclasses.replace(t, n_layers=layers, moe=moe)).validate()
    if tiny:
        return random_model(cfg, dtype=jnp.float32, seed=seed)
    md3 = name == "md3"
    return random_model(cfg, fp8_experts=md3, kv_scale=0.05 if md3 else None)


def family(kernel: str) -> str:
    """A kernel name without XLA's numeric suffix (loop_add_fusion_17 -> loop_add_fusion)."""
    return re.sub(r"[._]\d+$", "", kernel)


_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) (?:fusion|custom-call)\((.*)$", re.M)


def hlo_index(text: str) -> dict[str, str]:
    """Fusions and custom calls of an optimized HLO module: instruction name -> "shape  op" (the
    output shape and the tail of the op_name that made it), keyed as CUPTI names the kernels
    (loop_add_fusion.18 runs as loop_add_fusion_18)."""
    out: dict[str, str] = {}
    for m in _INSTR.finditer(text):
        name, shape, rest = m.groups()
        op = re.search(r'op_name="([^"]*)"', rest)
        where = op.group(1).split("/")[-2:] if op else []
        out[re.sub(r"\.(\d+)$", r"_\1", name)] = f"{shape[:70]}  {'/'.join(where)}"
    return out


def aggregate_runs(runs: list[list[tuple[str, float]]]) -> list[dict[str, Any]]:
    """CUPTI runs of one step ([(kernel, ms)] each) -> per kernel name, in first-seen order: the
    median over runs of its summed time (us) and its most launches in a run. A name missing from a
    run counts 0 there (separately measured runs need not list the same kernels: a one-off copy)."""
    order: list[str] = []
    per_run: list[dict[str, tuple[float, int]]] = []
    for run in runs:
        seen: dict[str, tuple[float, int]] = {}
        for name, ms in run:
            if name not in order:
                order.append(name)
            us, n = seen.get(name, (0.0, 0))
            seen[name] = (us + ms * 1e3, n + 1)
        per_run.append(seen)
    return [{"kernel": n, "us": round(float(np.median([r.get(n, (0.0, 0))[0] for r in per_run])), 2),
             "launches": max(r.get(n, (0.0, 0))[1] for r in per_run)} for n in order]


def measure_runs(fn: Any, args: tuple[Any, ...], iters: int) -> tuple[list[list[tuple[str, float]]], str]:
    """`iters` measurements of `fn(*args)`: CUPTI's [(kernel, ms)] per run, else one host-timed
    pseudo-kernel per run (CPU, or where CUPTI is unavailable). `fn` is a jitted function or a
    compiled one; it must not donate its arguments (they are passed again every iteration). The
    arrays go in as arguments: the profiler jits whatever callable it is given, and a closure over
    the weights would bake them into the program as constants (15 GB for MD3: minutes of compile)."""
    compiled = fn if isinstance(fn, jax.stages.Compiled) else fn.lower(*args).compile()
    try:
        from jax.experimental.mosaic.gpu import profiler

        # one iteration per measurement: measure(iterations=n) holds all n outputs at once, and a
        # step's output is its whole KV pool (MD2's bf16 pool for 64 rows of 1024: 14 GB)
        runs: list[list[tuple[str, float]]] = []
        for _ in range(iters):
            out, measured = profiler.measure(compiled, aggregate=False, iterations=1)(*args)
            del out
            if not measured:
                raise RuntimeError("CUPTI saw no kernels")
            runs.append(list(measured))
        return runs, "cupti"
    except Exception as e:  # noqa: BLE001 - a probe: fall back to host timing
        jax.block_until_ready(compiled(*args))
        runs = []
        for _ in range(iters):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            runs.append([("(host-timed step)", (time.perf_counter() - t0) * 1e3)])
        return runs, f"host timing ({type(e).__name__}: {e})"


def per_kernel(fn: Any, args: tuple[Any, ...], iters: int) -> tuple[list[dict[str, Any]], str]:
    """[(kernel, median us over iterations, launches per call)] of `fn(*args)` (`measure_runs`)."""
    runs, how = measure_runs(fn, args, iters)
    return aggregate_runs(runs), how


def parse_ab(spec: str | None) -> tuple[str, list[str]] | None:
    """--ab NAME=V1,V2[,...] -> (NAME, [V1, V2, ...]); None without one."""
    if not spec:
        return None
    name, eq, values = spec.partition("=")
    vals = [v.strip() for v in values.split(",") if v.strip()]
    if not eq or not name.startswith("KESTREL_JAX_") or len(vals) < 2:
        raise SystemExit(f"--ab wants KESTREL_JAX_NAME=V1,V2[,...], got {spec!r}")
    return name, vals


def parse_sets(specs: list[str] | None) -> list[tuple[str, dict[str, str]]] | None:
    """--sets SPEC SPEC ...: each variant `default` (the environment as it is) or switches joined
    by `+` (KESTREL_JAX_A=1+KESTREL_JAX_B=0) -> [(label, {name: value})]; None without any."""
    if not specs:
        return None
    out = []
    for spec in specs:
        env: dict[str, str] = {}
        if spec.strip() != "default":
            for part in spec.split("+"):
                name, eq, value = part.strip().partition("=")
                if not eq or not name.startswith("KESTREL_JAX_") or not value:
                    raise SystemExit(f"--sets wants default or KESTREL_JAX_A=V[+KESTREL_JAX_B=V...], got {spec!r}")
                env[name] = value
        out.append((spec.strip(), env))
    if len(out) < 2 or len({label for label, _ in out}) < len(out):
        raise SystemExit(f"--sets wants at least two distinct variants, got {specs!r}")
    return out


def variant_sets(ab: tuple[str, list[str]] | None,
                 sets: list[tuple[str, dict[str, str]]] | None) -> list[tuple[str, dict[str, str]]] | None:
    """The variants of an in-process A/B: --ab's values of one switch, or --sets' (not both)."""
    if ab and sets:
        raise SystemExit("--ab and --sets are two ways to name variants: give one")
    if ab:
        return [(f"{ab[0]}={v}", {ab[0]: v}) for v in ab[1]]
    return sets


def apply_variant(env: dict[str, str], names: set[str], saved: dict[str, str | None]) -> None:
    """Set os.environ for one variant: every switch any variant names back to its saved value,
    then this variant's."""
    for name in names:
        if saved.get(name) is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved[name]  # type: ignore[assignment]
    os.environ.update(env)


def interleaved(fns: list[Any], args: tuple[Any, ...], iters: int,
                measure: Any = measure_runs) -> tuple[list[list[list[tuple[str, float]]]], str]:
    """One measurement of each variant in turn, `iters` rounds (A B A B ...: drift on the machine
    lands on every variant alike): the runs per variant, and how they were timed."""
    runs: list[list[list[tuple[str, float]]]] = [[] for _ in fns]
    how = ""
    for _ in range(iters):
        for i, fn in enumerate(fns):
            r, how = measure(fn, args, 1)
            runs[i] += r
    return runs, how


def wall_times(fns: list[Any], args: tuple[Any, ...], rounds: int) -> list[tuple[float, float]]:
    """Host-timed (wall, launch) of one blocking call of each variant (us, medians of `rounds`,
    taken in turn as `interleaved`). Wall: what the CUPTI sum cannot show (launch gaps, work that
    overlaps); a call includes its dispatch and the probe's undonated KV-pool copy, alike for every
    variant. Launch: until the call returns, before its outputs are ready: the host time a pipelined
    engine must hide under the previous step (steps that launch slower than the device runs them
    leave it idle)."""
    for fn in fns:  # warm: the first call of a compiled step allocates
        jax.block_until_ready(fn(*args))
    times: list[list[tuple[float, float]]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            out = fn(*args)
            t1 = time.perf_counter()
            jax.block_until_ready(out)
            times[i].append(((time.perf_counter() - t0) * 1e6, (t1 - t0) * 1e6))
    return [(float(np.median([w for w, _ in t])), float(np.median([x for _, x in t]))) for t in times]


def putting(fn: Any, device: Any) -> Any:
    """`fn` called with its numpy arguments put on `device` first (jax.device_put)."""
    def call(*args: Any) -> Any:
        return fn(*put_host_arrays(args, device))
    return call


def host_trace(fn: Any, args: tuple[Any, ...], where: Path, calls: int = 3) -> dict[str, Any]:
    """Profile `calls` blocking calls of `fn` (host tracer on, Python tracer off) into `where` and
    summarize the host threads' events: for the busiest threads, each event name's inclusive time
    and count per call (nested events each count)."""
    jax.block_until_ready(fn(*args))
    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level = 0
    opts.host_tracer_level = 2
    opts.enable_hlo_proto = False
    jax.profiler.start_trace(str(where), profiler_options=opts)
    try:
        for _ in range(calls):
            jax.block_until_ready(fn(*args))
    finally:
        jax.profiler.stop_trace()
    files = sorted(where.rglob("*.xplane.pb"), key=lambda f: f.stat().st_mtime)
    if not files:
        return {"calls": calls, "lines": [], "error": f"no .xplane.pb under {where}"}
    from jax.profiler import ProfileData

    return summarize_host_lines(ProfileData.from_file(str(files[-1])), calls) | {"file": str(files[-1])}


def summarize_host_lines(data: Any, calls: int, lines: int = 3, top: int = 30) -> dict[str, Any]:
    """The `lines` host threads with the most event time: per event name, time and count per call."""
    found = []
    for plane in data.planes:
        if not plane.name.startswith("/host"):
            continue
        for line in plane.lines:
            by: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
            for ev in line.events:
                b = by[ev.name[:90]]
                b[0] += 1
                b[1] += ev.duration_ns / 1e3
            if by:
                found.append((sum(v[0] for v in by.values()), line.name, by))
    found.sort(key=lambda t: -t[0])
    return {"calls": calls, "lines": [
        {"line": name, "events_per_call": round(n / calls, 1),
         "top": [{"name": k, "per_call": round(v[0] / calls, 1), "us_per_call": round(v[1] / calls, 1)}
                 for k, v in sorted(by.items(), key=lambda kv: -kv[1][1])[:top]]}
        for n, name, by in found[:lines]]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="md3", choices=["md2", "md3"])
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny model (a CPU smoke run)")
    ap.add_argument("--kinds", default="prefill,mixed,decode",
                    help="comma list of prefill, mixed, decode, vision, images")
    ap.add_argument("--crops", type=int, default=1,
                    help="vision bucket (crops per image; 1: the one-crop encoding of a 1x1 tiling)")
    ap.add_argument("--images", type=int, default=4,
                    help="one-crop images encoded together by the `images` step (a `vision_image_batches` count)")
    ap.add_argument("--tokens", type=int, default=2048, help="prefill token bucket")
    ap.add_argument("--prompt", type=int, default=740, help="tokens of each of the two prefilled prompts")
    ap.add_argument("--batch", type=int, default=64, help="decode rows (decode and mixed steps)")
    ap.add_argument("--context", type=int, default=800, help="position of each decode row's new token")
    ap.add_argument("--steps", type=int, default=1, help="decode iterations per decode launch")
    ap.add_argument("--text-step", action="store_true",
                    help="decode: the text step (no region heads; what multi-step launches of text rows run)")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--wall-rounds", type=int, default=20,
                    help="host-timed blocking calls per variant for the wall clock (0: none)")
    ap.add_argument("--top", type=int, default=40, help="kernel families printed per step")
    ap.add_argument("--kernels", type=int, default=40, help="kernels printed per step, with their HLO shapes")
    ap.add_argument("--out-dir", default=None, help="step_kernels.json and each step's optimized HLO (gzip)")
    ap.add_argument("--json", default=None, help="the results alone, to this path (tools/diff_step_kernels.py)")
    ap.add_argument("--ab", default=None, metavar="KESTREL_JAX_NAME=V1,V2",
                    help="each step compiled once per value of this switch (read at trace time) and measured "
                         "in turn, A B A B ...; --json then names one file per value (PATH stem + _NAME=V) and "
                         "the diff against the first value is printed")
    ap.add_argument("--sets", nargs="+", default=None, metavar="SPEC",
                    help="as --ab, with variants of several switches each: default, or "
                         "KESTREL_JAX_A=V[+KESTREL_JAX_B=V...] (e.g. default KESTREL_JAX_MERGED_PROJ=1)")
    ap.add_argument("--device-inputs", action="store_true",
                    help="the step inputs put on the device once and passed again each call (default: host "
                         "numpy arrays, copied each call, as the engine sends them)")
    ap.add_argument("--put-inputs", action="store_true",
                    help="each call puts the numpy step inputs on the device first (jax.device_put, inside the "
                         "timed call), as the engine does with RunnerConfig.put_inputs")
    ap.add_argument("--host-trace", default=None, metavar="DIR",
                    help="profile a few blocking calls of each step into DIR and print the host threads' "
                         "events per call by inclusive time (what the launch spends its host time on)")
    ap.add_argument("--fused-dense-decode", default="auto", choices=("auto", "on", "off"),
                    help="RunnerConfig.fused_dense_decode (the dense layers' decode QKV + fc1 over joined weights)")
    a = ap.parse_args()
    ab = variant_sets(parse_ab(a.ab), parse_sets(a.sets))
    names = {n for _, env in ab or [] for n in env}
    saved = {n: os.environ.get(n) for n in names}
    model = synthetic_model(a.model, tiny=a.tiny)
    page = a.page
    per_row = a.context // page + 1  # pages of a decode row
    per_seq = -(-a.prompt // page)
    max_seq = max(a.context + 1, a.prompt, a.tokens)
    cfg = RunnerConfig(num_pages=a.batch * per_row + 2 * per_seq, page_size=page,
                       max_seq_len=-(-max_seq // page) * page, vision_buckets=(a.crops,),
                       fused_dense_decode=a.fused_dense_decode)
    runner = Runner(model, cfg, out_rows=a.batch + 2)
    p = runner.max_pages_per_seq
    rng = np.random.default_rng(0)
    vocab = model.cfg.text.vocab_size
    seqs = [(a.batch * per_row + i * per_seq, rng.integers(1, vocab, a.prompt).tolist()) for i in range(2)]
    pre = bt.text_prefill(seqs, tokens=a.tokens, max_seqs=2, pages=p, page_size=page)
    rows = [(i * per_row, a.context, int(rng.integers(1, vocab)), -1) for i in range(a.batch)]
    dec = bt.text_decode(rows, bucket=a.batch, pages=p, page_size=page)
    images = jnp.zeros((1, model.cfg.text.prefix_attn - 1, model.cfg.text.dim), model.dtype)
    out_dir = Path(a.out_dir) if a.out_dir else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"device": jax.devices()[0].device_kind, "model": a.model, "tiny": a.tiny,
                           "settings": {k: v for k, v in vars(a).items() if k not in ("out_dir", "json")},
                           "switches": {k: v for k, v in sorted(os.environ.items()) if k.startswith("KESTREL_JAX_")},
                           "steps": {}}
    # --ab / --sets: one result per variant, each naming its values among the switches
    variants = {label: {**res, "switches": {**res["switches"], **env}, "steps": {}} for label, env in ab} if ab else {}
    for kind in [k.strip() for k in a.kinds.split(",") if k.strip()]:
        step_fn: Any
        args: tuple[Any, ...]
        if kind == "prefill":
            step_fn, args = runner._prefill.jitted, (runner.lm_params, runner.cache, *pre, images)
        elif kind == "mixed":
            step_fn = runner._mixed.jitted
            args = (runner.lm_params, runner.cache, *dec, runner._feed(None), *pre, images)
        elif kind == "decode":
            step_fn = runner._decode_fn(a.steps, not a.text_step).jitted
            args = (runner.lm_params, runner.cache, *dec, runner._feed(None))
        elif kind == "vision":
            step_fn = runner._vision
            vc = model.cfg.vision
            crops = jnp.asarray(rng.integers(0, 256, (a.crops, vc.crop_size, vc.crop_size, 3), np.uint8))
            tiling = (1, 1) if a.crops <= 2 else (1, a.crops - 1)
            args = (runner.vision_params, crops, *map(jnp.asarray, tile_pool_matrices(tiling, vc, max(1, a.crops - 1))))
        elif kind == "images":
            if a.images not in runner.image_batches:
                raise SystemExit(f"--images {a.images} is not among the runner's image counts {runner.image_batches}")
            step_fn = runner._vision_images
            vc = model.cfg.vision
            singles = tuple(jnp.asarray(rng.integers(0, 256, (1, vc.crop_size, vc.crop_size, 3), np.uint8))
                            for _ in range(a.images))
            args = (runner.vision_params, singles, *map(jnp.asarray, tile_pool_matrices((1, 1), vc, 1)))
        else:
            raise SystemExit(f"unknown step kind {kind!r}")
        if a.device_inputs:
            args = tuple(jax.device_put(x, runner.device) if isinstance(x, np.ndarray) else x for x in args)
        # the runner's step donates the KV pool; the probe runs it again and again on the same pool
        labels: list[str | None] = [label for label, _ in ab] if ab else [None]
        compiled_v = []
        for env in [e for _, e in ab] if ab else [None]:
            if env is not None:
                apply_variant(env, names, saved)
                jax.clear_caches()  # the switch is read when a step (or a kernel's entry point) is traced
                ops._jitted.cache_clear()
            compiled_v.append(jax.jit(getattr(step_fn, "__wrapped__", step_fn)).lower(*args).compile())
        runs_v, how = interleaved(compiled_v, args, a.iters)
        # host-timed calls (wall, launch, host trace) as the engine makes them: with --put-inputs,
        # each call puts its numpy inputs first (the kernels are the same either way)
        timed_v = [putting(fn, runner.device) for fn in compiled_v] if a.put_inputs else compiled_v
        walls = wall_times(timed_v, args, a.wall_rounds) if a.wall_rounds else [None] * len(labels)
        if a.host_trace:
            for label, compiled in zip(labels, timed_v, strict=True):
                where = Path(a.host_trace) / f"{kind}{'' if label is None else '_' + label}"
                summary = host_trace(compiled, args, where)
                (variants[label] if label is not None else res).setdefault("host_trace", {})[kind] = summary
                print(f"{'' if label is None else f'[{label}] '}{kind}: host events per call ({summary['calls']} "
                      f"calls traced, {where}):", flush=True)
                for line in summary["lines"]:
                    print(f"  thread {line['line']!r}: {line['events_per_call']} events per call", flush=True)
                    for e in line["top"][:a.top]:
                        print(f"    {e['us_per_call']:9.1f} us  x{e['per_call']:<7} {e['name']}", flush=True)
        for label, compiled, runs, wall in zip(labels, compiled_v, runs_v, walls, strict=True):
            if label is None:
                report(kind, compiled, aggregate_runs(runs), how, res, a, out_dir, wall=wall)
            else:
                report(kind, compiled, aggregate_runs(runs), how, variants[label], a, out_dir,
                       label=f"[{label}] ", wall=wall)
    if ab:
        first = variants[ab[0][0]]
        for label, _ in ab[1:]:
            print(f"{ab[0][0]} -> {label}:", flush=True)
            print("\n".join(diff_steps(first, variants[label], 15)), flush=True)
    if out_dir is not None:
        (out_dir / "step_kernels.json").write_text(json.dumps({"variants": variants} if ab else res, indent=1))
    if a.json:
        if ab:
            path = Path(a.json)
            for label, r in variants.items():
                path.with_name(f"{path.stem}_{label}{path.suffix}").write_text(json.dumps(r, indent=1))
        else:
            Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


def report(kind: str, compiled: Any, kernels: list[dict[str, Any]], how: str, res: dict[str, Any], a: Any,
           out_dir: Path | None, label: str = "", wall: tuple[float, float] | None = None) -> None:
    """One step's kernels into `res["steps"][kind]` (with the HLO beside them in `out_dir`), printed
    by family and by kernel; `label` names the --ab variant; `wall`: `wall_times`' figures."""
    if out_dir is not None:
        tag = label.strip(" []").replace("=", "_")
        with gzip.open(out_dir / f"step_{kind}{'_' + tag if tag else ''}.hlo.txt.gz", "wt") as f:
            f.write(compiled.as_text() or "")
    index = hlo_index(compiled.as_text() or "")
    fam: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    r: dict[str, Any]
    for r in kernels:
        r["hlo"] = index.get(r["kernel"], "")
        fam[family(r["kernel"])][0] += r["launches"]
        fam[family(r["kernel"])][1] += r["us"]
    total = sum(r["us"] for r in kernels)
    fams: list[dict[str, Any]] = [{"family": k, "launches": int(v[0]), "us": round(v[1], 1)} for k, v in
                                  sorted(fam.items(), key=lambda kv: -kv[1][1])]
    step: dict[str, Any] = {"timing": how, "total_us": round(total, 1),
                            "launches": sum(r["launches"] for r in kernels), "families": fams, "kernels": kernels}
    said = ""
    if wall is not None:
        step["wall_us"], step["launch_us"] = round(wall[0], 1), round(wall[1], 1)
        said = (f"; wall {wall[0]:.1f} us per blocking call, of which {wall[1]:.1f} us until the call "
                f"returned (host-timed medians)")
    res["steps"][kind] = step
    print(f"{label}{kind}: {total:.1f} us in {step['launches']} launches ({how}){said}", flush=True)
    for f_ in fams[:a.top]:
        print(f"   {f_['us']:9.1f} us  x{f_['launches']:<4d} {f_['family'][:100]}", flush=True)
    print(f"  {kind}: kernels by time (us per launch, launches, the HLO's output shape and op)", flush=True)
    for r in sorted(kernels, key=lambda r: -r["us"])[:a.kernels]:
        per = r["us"] / max(1, r["launches"])
        print(f"   {per:8.2f} us x{r['launches']:<3d} {r['kernel'][:44]:44s} {r['hlo']}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
