#!/usr/bin/env python3
"""A/B of the engine loop's pipelining on one engine: batch-1 TTFT and decode tok/s with the loop
launching step N+1 before reading step N (pipeline on) and reading each step at once (off).

  PYTHONPATH=. python3 tools/pipeline_ab.py [--model md2|md3|tiny-md2] [--tokens 128] [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time

import numpy as np


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="md2")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    from kestrel_jax.models.config import md2_config, md3_config, tiny_config
    from kestrel_jax.models.moondream import random_model
    from kestrel_jax.serving.engine import EngineConfig, InferenceEngine
    from kestrel_jax.serving.runner import RunnerConfig

    cfgs = {"md2": md2_config, "md3": md3_config, "tiny-md2": lambda: tiny_config("md2")}
    md3 = a.model == "md3"
    model = random_model(cfgs[a.model](), fp8_experts=md3, kv_scale=0.05 if md3 else None)
    t = time.perf_counter()
    eng = await InferenceEngine.create(EngineConfig(
        runner=RunnerConfig(max_seq_len=2048, vision_buckets=(2,)), decode_buckets=(1,),
        prefill_token_buckets=(1024,), max_prefill_seqs=2), model=model)
    print(f"engine up in {time.perf_counter() - t:.1f}s", flush=True)
    rng = np.random.default_rng(0)
    settings = {"temperature": 0.0, "max_tokens": a.tokens, "ignore_eos": True}
    worker = eng._worker
    for pipe in (True, False, True):
        worker.config = dataclasses.replace(worker.config, pipeline=pipe)
        for _ in range(a.reps):
            r = await eng.query(rng.integers(0, 255, (378, 378, 3), dtype=np.uint8), "What is in this image?",
                                reasoning=False, settings=settings)
            m = r.metrics  # type: ignore[union-attr]
            print(f"pipeline={pipe!s:5} ttft {m.ttft_ms:7.1f} ms (queue {m.queue_time_ms:5.1f}, prefill "
                  f"{m.prefill_time_ms:6.1f}) decode {m.tokens_per_s:7.1f} tok/s", flush=True)
    await eng.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
