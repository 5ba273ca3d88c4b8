"""Run by test_multi_device.py in a process of its own (two host CPU devices must be set up
before JAX starts): the same requests through an engine on both devices and through a one-device
engine on device 1; prints a JSON summary for the test to check."""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"

import asyncio  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402

from kestrel_jax.serving.engine import EngineConfig, InferenceEngine, Stream  # noqa: E402
from kestrel_jax.serving.runner import RunnerConfig  # noqa: E402


def config(ckpt: str, **over: Any) -> EngineConfig:
    return EngineConfig(model_path=ckpt, dtype="float32",
                        runner=RunnerConfig(num_pages=64, kv_dtype="f32", max_seq_len=1024, page_size=64,
                                            vision_buckets=(1,), vision_image_batches=(), device_crops="on",
                                            **over.pop("runner", {})),
                        # one decode bucket, one decode iteration per launch and no mixed steps: each device
                        # compiles every variant (a CPU program is bound to its device), and what is checked
                        # here (outputs, placement, routing, cancellation) is the workers', not the steps'
                        # (those are tested on one device); (1, 4) took ~40 s more CPU time, the multi-step
                        # decode and mixed variants ~27 s more (43 s against 25 s for the whole script)
                        decode_buckets=(4,), prefill_token_buckets=(1024,), max_prefill_seqs=4, decode_steps=1,
                        mixed_decode_buckets=(), **over)


async def serve(engine: InferenceEngine, images: list[str]) -> dict[str, Any]:
    greedy = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    jobs = [engine.query(images[0], "What is here?", reasoning=False, settings=greedy),
            engine.query(images[1], "Describe it.", reasoning=False, settings=greedy),
            engine.query(images[0], "Any colours?", reasoning=False, settings=greedy),
            engine.query(None, "Hello there", reasoning=False, settings=greedy),
            engine.query(None, "Count to ten", reasoning=False, settings=greedy),
            engine.point(images[1], "thing")]
    results = [r for r in await asyncio.gather(*jobs) if not isinstance(r, Stream)]
    long = await engine.query(None, "Tell me everything", reasoning=False, stream=True,
                              settings={"max_tokens": 300, "ignore_eos": True})
    assert isinstance(long, Stream)
    async for _ in long:
        long.cancel()
        break
    cancelled = await long.result()
    # a caller that stops waiting (its task cancelled, as a timeout does) once its request runs:
    # the request ends on its device too
    workers = getattr(engine._worker, "workers", [engine._worker])
    admitted = sum(w.scheduler.stats.admitted for w in workers)
    task = asyncio.ensure_future(engine.query(None, "Go on and on", reasoning=False,
                                              settings={"max_tokens": 300, "ignore_eos": True}))
    while sum(w.scheduler.stats.admitted for w in workers) == admitted:
        await asyncio.sleep(0.01)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    while any(w.held() for w in workers):  # the cancellation reaches the device's engine thread
        await asyncio.sleep(0.01)
    return {"outputs": [r.output for r in results], "cancelled": cancelled.finish_reason}


def main() -> None:
    ckpt, images = sys.argv[1], sys.argv[2:4]
    assert len(jax.local_devices()) == 2
    out: dict[str, Any] = {}
    for name, cfg in (("two", config(ckpt, num_devices=2)), ("one", config(ckpt, runner={"device": 1}))):
        engine = asyncio.run(InferenceEngine.create(cfg))
        out[name] = asyncio.run(serve(engine, images))
        stats = engine.stats
        out[name]["devices"] = [{"admitted": d["scheduler"].admitted, "live": d["live"],
                                 "cancelled": d["scheduler"].cancelled,
                                 "hits": d["prefix_cache"].hits,
                                 "platform_device": str(w.runner.device),
                                 "params_on": sorted({str(d_) for a in w.runner.lm_params for d_ in a.devices()})}
                                for d, w in zip(stats.get("devices", [stats]),
                                                getattr(engine._worker, "workers", [engine._worker]), strict=True)]
        out[name]["live"] = stats["live"]
        out[name]["max_requests"] = engine.max_requests
        asyncio.run(engine.shutdown())
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
