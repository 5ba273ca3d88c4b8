#!/usr/bin/env python3
"""GPU smoke test of the whole engine: does it compile and agree with the XLA reference path on a
real GPU, and roughly how fast is it? (The full benchmark is tools/benchmark.py.)

  PYTHONPATH=. python3 tools/gpu_smoke.py --out $OUT/smoke.json [--full md3,md2] [--backends reference,auto]

1. Tiny synthetic MD3 (random weights): the same greedy requests through the engine with the
   jnp-reference kernels and with the Pallas kernels; outputs must agree.
2. Full-size random MD2/MD3 (weights created on the device): start-up time, batch-1 decode
   tokens/s of a 128-token answer, and a burst of 32 concurrent requests, per backend.
Each part records its own failure and the script goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import traceback
from typing import Any

import numpy as np


def log(msg: str) -> None:
    print(f"[smoke {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def copy_bandwidth() -> float:
    import jax
    import jax.numpy as jnp

    x = jnp.ones((1 << 30) // 4, jnp.float32)  # 1 GiB, read and written in place (donated)
    nbytes = x.nbytes
    f = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    for _ in range(3):  # compile; the allocator settles
        x = f(x)
    x.block_until_ready()
    t = time.perf_counter()
    n = 10
    for _ in range(n):
        x = f(x)
    x.block_until_ready()
    dt = (time.perf_counter() - t) / n
    return 2 * nbytes / dt / 1e9


async def run_requests(engine: Any, images: list[np.ndarray], max_tokens: int, concurrency: int) -> dict[str, Any]:
    settings = {"temperature": 0.0, "top_p": 1.0, "max_tokens": max_tokens, "ignore_eos": True}
    sem = asyncio.Semaphore(concurrency)

    async def one(img: np.ndarray) -> Any:
        async with sem:
            return await engine.query(img, "What is in this image?", reasoning=False, settings=settings)

    t = time.perf_counter()
    res = await asyncio.gather(*(one(im) for im in images))
    wall = time.perf_counter() - t
    toks = sum(r.metrics.output_tokens for r in res)
    return {
        "requests": len(res), "wall_s": wall, "req_per_s": len(res) / wall, "out_tok_per_s": toks / wall,
        "ttft_ms_p50": float(np.median([r.metrics.ttft_ms for r in res])),
        "decode_tok_s_p50": float(np.median([r.metrics.tokens_per_s for r in res])),
        "finish": sorted({r.finish_reason for r in res}),
        "output_tokens": sorted({r.metrics.output_tokens for r in res}),
        "outputs": [r.output for r in res],  # in request order: runs under other settings compare
    }


def engine_config(backend: str, *, family: str, tiny: bool, compile_cache: str | None = None) -> Any:
    from kestrel_jax.serving.engine import EngineConfig
    from kestrel_jax.serving.runner import RunnerConfig

    kv = "fp8" if family == "md3" else "bf16"
    if tiny:
        return EngineConfig(runner=RunnerConfig(num_pages=256, kv_dtype=kv, max_seq_len=2048, backend=backend,
                                                vision_buckets=(2, 10)),
                            decode_buckets=(1, 4), prefill_token_buckets=(64, 1024), max_prefill_seqs=4)
    # Prefix cache off: every request has a new image except the repeated batch-1 ones, which must
    # run the same steps again.
    return EngineConfig(runner=RunnerConfig(kv_dtype=kv, max_seq_len=2048, backend=backend, vision_buckets=(2,),
                                            kv_memory_fraction=0.5, compilation_cache_dir=compile_cache),
                        decode_buckets=(1, 16), prefill_token_buckets=(1024,), max_prefill_seqs=1,
                        enable_prefix_cache=False)


def part_tiny(backends: list[str]) -> dict[str, Any]:
    from kestrel_jax.models.config import tiny_config
    from kestrel_jax.models.moondream import random_model
    from kestrel_jax.serving.engine import InferenceEngine

    out: dict[str, Any] = {}
    rng = np.random.default_rng(0)
    imgs = [rng.integers(0, 255, (378, 378, 3), dtype=np.uint8), rng.integers(0, 255, (480, 640, 3), dtype=np.uint8)]
    answers: dict[str, Any] = {}
    for backend in backends:
        try:
            model = random_model(tiny_config("md3"), fp8_experts=True, kv_scale=0.05, seed=1)
            t = time.perf_counter()

            async def go(model: Any = model, backend: str = backend, t: float = t) -> Any:
                eng = await InferenceEngine.create(engine_config(backend, family="md3", tiny=True), model=model)
                start = time.perf_counter() - t
                g = {"temperature": 0.0, "max_tokens": 16}
                rs = await asyncio.gather(
                    eng.query(imgs[0], "What is this?", reasoning=False, settings=g),
                    eng.caption(imgs[1], length="short", settings=g),
                    eng.detect(imgs[0], "car", settings={"max_objects": 3}),
                    eng.point(imgs[1], "sun", settings={"max_objects": 3}),
                    eng.query(imgs[1], "How many?", reasoning=True, settings={"temperature": 0.0, "max_tokens": 8}))
                await eng.shutdown()
                return start, [getattr(r, "output", None) for r in rs]  # Results (no stream requested)

            start, outs = asyncio.run(go())
            answers[backend] = outs
            out[backend] = {"startup_s": start, "outputs": outs}
            log(f"tiny {backend}: startup {start:.1f}s, outputs {str(outs)[:300]}")
        except Exception as e:
            out[backend] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
            log(f"tiny {backend} FAILED: {e}")
    if len(answers) == 2:
        a, b = answers.values()
        out["text_equal"] = [x == y for x, y in zip(a, b, strict=True)]
        log(f"tiny outputs equal across backends: {out['text_equal']}")
    return out


def part_full(family: str, backends: list[str], n_burst: int, compile_cache: str | None = None) -> dict[str, Any]:
    import jax

    from kestrel_jax.models.config import md2_config, md3_config
    from kestrel_jax.models.moondream import random_model
    from kestrel_jax.serving.engine import InferenceEngine

    out: dict[str, Any] = {}
    cfg = md3_config() if family == "md3" else md2_config()
    rng = np.random.default_rng(1)
    for backend in backends:
        try:
            t = time.perf_counter()
            model = random_model(cfg, fp8_experts=family == "md3", kv_scale=0.05 if family == "md3" else None)
            jax.block_until_ready(jax.tree.leaves(model))
            build = time.perf_counter() - t

            async def go(model: Any = model, backend: str = backend, build: float = build) -> dict[str, Any]:
                t0 = time.perf_counter()
                ecfg = engine_config(backend, family=family, tiny=False, compile_cache=compile_cache)
                eng = await InferenceEngine.create(ecfg, model=model)
                r: dict[str, Any] = {"build_s": build, "startup_s": time.perf_counter() - t0, "stats": eng.stats}
                log(f"{family} {backend}: engine up in {r['startup_s']:.1f}s (weights {build:.1f}s)")
                img = lambda: rng.integers(0, 255, (378, 378, 3), dtype=np.uint8)  # noqa: E731
                await run_requests(eng, [img()], 8, 1)  # warm
                ims = [img() for _ in range(3)]
                r["batch1"] = await run_requests(eng, ims, 128, 1)
                log(f"{family} {backend} batch-1: {r['batch1']}")
                # The same requests again (the prefix cache is off): the same step programs with other
                # buffers (KV pages, inputs, outputs) must give the same tokens.
                again = await run_requests(eng, ims, 128, 1)
                r["batch1_repeat_equal"] = [a == b for a, b in zip(r["batch1"]["outputs"], again["outputs"],
                                                                   strict=True)]
                log(f"{family} {backend} batch-1 repeated, outputs equal: {r['batch1_repeat_equal']}")
                r["burst"] = await run_requests(eng, [img() for _ in range(n_burst)], 128, n_burst)
                log(f"{family} {backend} burst {n_burst}: {r['burst']}")
                await eng.shutdown()
                return r

            out[backend] = asyncio.run(go())
            del model
        except Exception as e:
            out[backend] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
            log(f"{family} {backend} FAILED: {e}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="smoke.json")
    ap.add_argument("--full", default="md3,md2")
    ap.add_argument("--backends", default="reference,auto")
    ap.add_argument("--full-backends", default="auto")
    ap.add_argument("--burst", type=int, default=32)
    ap.add_argument("--skip-tiny", action="store_true")
    ap.add_argument("--compile-cache", default=None,
                    help="full-size engines: persistent compile cache (a second process loads the same executables)")
    args = ap.parse_args()
    import jax

    import kestrel_jax  # noqa: F401 - puts its XLA defaults (SKIP_TEMP) in place before JAX's backend starts

    res: dict[str, Any] = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
                           "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    log(f"device {res['device']} jax {jax.__version__}")
    try:
        res["copy_GBps"] = copy_bandwidth()
        log(f"copy bandwidth {res['copy_GBps']:.0f} GB/s")
    except Exception as e:
        res["copy_GBps"] = f"error {e}"
    backends = [b for b in args.backends.split(",") if b]
    if not args.skip_tiny:
        res["tiny"] = part_tiny(backends)
    for fam in [f for f in args.full.split(",") if f]:
        res[fam] = part_full(fam, [b for b in args.full_backends.split(",") if b], args.burst, args.compile_cache)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sys.exit(main())
