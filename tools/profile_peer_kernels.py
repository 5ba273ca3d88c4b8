#!/usr/bin/env python3
"""Kestrel's own kernels on this GPU, kernel by kernel, inside its engine (GPU only).

The kernel issues' targets are Kestrel's published H100 figures; this measures the peer's kernels
on the machine we are lent, so that ours and theirs compare on one GPU. It drives the real
Kestrel engine through the peer harness (../shared/peer, copied to .peer and installed by its
run_device.sh: wheels in PYTHONPATH, the random-weight checkpoint) with the same requests as our
benchmarks (a new 378 px random image, "What is in this image?", 128 output tokens), and records
every CUDA kernel with torch.profiler (CUPTI; kernels replayed from CUDA graphs included):

  b1_greedy   one greedy request: vision, the 740-token prefill, 127 decode steps at batch 1
  b1_sampled  one request at temperature 0.2 / top_p 0.9 (the sampling kernel at batch 1)
  burstN      N requests submitted together (decode steps at batch N, KV 741-868)

Per kernel name: launches, total, mean and median duration. Decode steps outnumber prefills
127 to 1, so a name's median is its decode-step time; names launched once per layer per request
are the prefill's. Each phase runs once unprofiled first (graph capture, warm-up).

  PYTHONPATH=/tmp/site:. python3 tools/profile_peer_kernels.py --peer-dir .peer \\
      --weights /tmp/peer/md3/model_fp8.pt --tokenizer /tmp/peer/md3/tokenizer.json --out peer_kernels.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any


def kernel_table(events: list[tuple[str, float]]) -> list[dict[str, Any]]:
    """(name, duration us) pairs -> per-name launches, total, mean and median, by total time."""
    by_name: dict[str, list[float]] = defaultdict(list)
    for name, us in events:
        by_name[name].append(us)
    rows = [{"kernel": k, "launches": len(v), "total_us": round(sum(v), 1), "mean_us": round(sum(v) / len(v), 3),
             "median_us": round(statistics.median(v), 3)} for k, v in by_name.items()]
    return sorted(rows, key=lambda r: -r["total_us"])


def cuda_kernels(prof: Any) -> list[tuple[str, float]]:
    import torch

    out = []
    for e in prof.events():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            out.append((e.name, float(e.time_range.elapsed_us())))
    return out


async def main_async(a: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(Path(a.peer_dir).resolve()))
    import bench_kestrel as peer  # the peer harness: engine config, images, one request
    from kestrel.engine import InferenceEngine

    args = argparse.Namespace(weights=a.weights, model=a.model, max_batch_size=max(a.bursts + [1]),
                              no_cuda_graphs=False, no_prefix_cache=False, kv_cache_pages=None,
                              tokenizer=a.tokenizer)
    cfg, kw = peer.build_engine_config(args)
    t0 = time.perf_counter()
    engine = await InferenceEngine.create(cfg)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "versions": peer.versions(),
                           "runtime_config": {k: str(v) for k, v in kw.items()},
                           "engine_init_s": round(time.perf_counter() - t0, 2), "phases": {}}
    imgs = peer.ImageSource(a.seed)
    greedy = {"temperature": 0.0, "top_p": 1.0, "max_tokens": a.max_tokens}
    sampled = {"temperature": 0.2, "top_p": 0.9, "max_tokens": a.max_tokens}
    phases: list[tuple[str, int, dict[str, Any]]] = [("b1_greedy", 1, greedy), ("b1_sampled", 1, sampled)]
    phases += [(f"burst{n}", n, greedy) for n in a.bursts]
    try:
        for name, n, settings in phases:
            async def run(n: int = n, settings: dict[str, Any] = settings) -> list[dict[str, Any]]:
                ims = [imgs.make(a.image_size) for _ in range(n)]
                return list(await asyncio.gather(*(peer.one_query(engine, im, a.question, settings) for im in ims)))

            try:
                await run()  # unprofiled: graph capture and warm-up at this batch size
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    t1 = time.perf_counter()
                    recs = await run()
                    torch.cuda.synchronize()
                    wall = time.perf_counter() - t1
            except Exception as exc:  # noqa: BLE001 - one failed phase keeps the others' tables
                res["phases"][name] = {"requests": n, "error": repr(exc)[:400]}
                print(f"== {name}: failed: {exc!r}", flush=True)
                continue
            table = kernel_table(cuda_kernels(prof))
            res["phases"][name] = {
                "requests": n, "settings": settings, "wall_s": round(wall, 4),
                "output_tokens": [r["output_tokens"] for r in recs],
                "decode_tok_s": [None if r["decode_tok_s"] is None else round(r["decode_tok_s"], 1) for r in recs],
                "kernel_launches": sum(r["launches"] for r in table),
                "kernel_us": round(sum(r["total_us"] for r in table), 1),
                "kernels": table[:a.keep]}
            print(f"== {name}: {n} requests, wall {wall * 1e3:.1f} ms, {len(table)} kernel names, "
                  f"{res['phases'][name]['kernel_launches']} launches, {res['phases'][name]['kernel_us']:.0f} us",
                  flush=True)
            for r in table[:a.top]:
                print(f"   {r['total_us']:10.1f} us  x{r['launches']:<6d} mean {r['mean_us']:8.2f}  "
                      f"median {r['median_us']:8.2f}  {r['kernel'][:110]}", flush=True)
    finally:
        await engine.shutdown()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer-dir", default=".peer", help="the peer harness folder (bench_kestrel.py)")
    ap.add_argument("--model", default="moondream3-preview", choices=["moondream3-preview", "moondream2"])
    ap.add_argument("--weights", type=Path, required=True, help="the peer's random-weight checkpoint")
    ap.add_argument("--tokenizer", type=Path, default=None)
    ap.add_argument("--bursts", type=int, nargs="*", default=[4, 8, 16, 32], help="concurrent request counts")
    ap.add_argument("--image-size", type=int, default=378)
    ap.add_argument("--question", default="What is in this image?")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=4321)
    ap.add_argument("--top", type=int, default=30, help="kernels printed per phase")
    ap.add_argument("--keep", type=int, default=80, help="kernels kept per phase in the JSON")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    res = asyncio.run(main_async(a))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
