#!/usr/bin/env python3
"""Decode-size GEMMs of the text decoder under XLA compile options (GPU).

    python3 tools/bench_decode_gemm.py --out $OUT/decode_gemm.json

At batch 1-8 every decoder GEMM streams its weight matrix once; XLA's Triton GEMM autotuner
picks the tiling, timing candidates on the same buffers again and again, i.e. with the weights
L2-resident whenever they fit in the 50 MB L2 (a [2048, 6144] bf16 QKV weight is 25 MB). In a
decode step they come from HBM. This script times each MD3 decode GEMM shape on `--layers`
distinct weight matrices per call (one program, cold weights: > 2x L2 in all), compiled with
each set of per-compilation XLA options (`jax.jit(..., compiler_options=...)`), and prints us
per GEMM, GB/s of weight streamed and the fraction of the measured copy bandwidth.

Kernel time is CUPTI's (jax.experimental.mosaic.gpu.profiler.measure: sum of kernel durations
of the program per call, launch gaps excluded), divided by the number of GEMMs.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, installed or not

from kestrel_jax.pallas import gemv_mgpu, moe, moe_mgpu  # noqa: E402

# name -> (K, N): MD3 decoder GEMMs at D = 2048 (MOONDREAM.md §3-4)
SHAPES = {
    "qkv": (2048, 6144),
    "proj": (2048, 2048),
    "router": (2048, 64),
    "qkv_router": (2048, 6208),  # an MoE layer's QKV and router products in one launch (decode)
    "dense_qkv_fc1": (2048, 14336),  # dense layers: QKV and fc1 read the same LayerNorm output
    "dense_fc2": (8192, 2048),
    "lm_head": (2048, 51200),
}

# label -> per-compilation XLA options. The override keys are AutotuneResult.TritonGemmKey text.
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "autotune0": {"xla_gpu_autotune_level": 0},
    "cublas": {"xla_gpu_enable_triton_gemm": False},
    "bm16_bn64_bk256_sk4": {"xla_gpu_override_gemm_autotuner":
                            "block_m: 16 block_n: 64 block_k: 256 split_k: 4 num_stages: 4 num_warps: 4 num_ctas: 1"},
    "bm16_bn32_bk256_sk2": {"xla_gpu_override_gemm_autotuner":
                            "block_m: 16 block_n: 32 block_k: 256 split_k: 2 num_stages: 4 num_warps: 4 num_ctas: 1"},
    "bm16_bn64_bk128_sk1": {"xla_gpu_override_gemm_autotuner":
                            "block_m: 16 block_n: 64 block_k: 128 split_k: 1 num_stages: 4 num_warps: 4 num_ctas: 1"},
    "bm16_bn32_bk128_sk1": {"xla_gpu_override_gemm_autotuner":
                            "block_m: 16 block_n: 32 block_k: 128 split_k: 1 num_stages: 4 num_warps: 4 num_ctas: 1"},
}
# label -> relative K split of the Pallas kernel (kestrel_jax/pallas/gemv_mgpu.py): 1 = its default
GEMV_VARIANTS = {"gemv": 1.0, "gemv_splits/2": 0.5, "gemv_splits*2": 2.0}
# label -> TMA ring depth of the rows kernel (`gemv_mgpu.gemv_rows`: no split, finished bf16 rows)
GEMV_ROWS_VARIANTS = {"gemv_rows": gemv_mgpu.ROWS_STAGES, "gemv_rows_st4": 4, "gemv_rows_st6": 6,
                      "gemv_rows_st12": 12, "gemv_rows_st16": 16}
# FP8 (e4m3) weights with a per-output-column f32 scale, through XLA: "xla_w8a16" upcasts the
# weight inside the product, "xla_w8a8" quantises the rows per row (absmax) and multiplies e4m3 by
# e4m3 with f32 accumulation. Bytes streamed: K * N * 1. (H100, session 51: XLA fused neither into a
# weight-streaming GEMM at these sizes, 11-21% of copy; BENCHMARKS.md.)
# "mgpu_w8a8" / "mgpu_w8a16": the same weights (stored [N, K], K contiguous) through the MoE's
# Mosaic grouped GEMM (`moe_mgpu._grouped_gemm`) with one expert and one block of rows: W8A8 with
# the rows quantised inside the kernel (<= 8 rows; more: quantised by XLA first), or W8A16 (weight
# tiles upcast in SMEM).
FP8_VARIANTS = ("xla_w8a16", "xla_w8a8", "mgpu_w8a8", "mgpu_w8a16")
ALL_VARIANTS = [*VARIANTS, *GEMV_VARIANTS, *GEMV_ROWS_VARIANTS, *FP8_VARIANTS]


def _fp8_weights(ws: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """[L, K, N] -> (e4m3 [L, K, N], f32 scale [L, N], the same e4m3 as [L, N, K]): per-output-column
    absmax, as `moe.quantize_experts` stores expert weights (one output row per column here)."""
    w8t, s = moe.quantize_experts(jnp.swapaxes(ws, 1, 2))
    return jnp.swapaxes(w8t, 1, 2), s, w8t


def _w8a16(x: jax.Array, w8: jax.Array, s: jax.Array) -> jax.Array:
    y = jnp.dot(x, w8.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * s).astype(x.dtype)


def _mgpu(x: jax.Array, w8t: jax.Array, s: jax.Array, a8: bool, interpret: object = None) -> jax.Array:
    """x [M, K] bf16, w8t [N, K] e4m3, s [N] f32 -> [Mp, N] bf16 (rows padded to 8)."""
    m, _ = x.shape
    nt = -(-m // 8) * 8
    xr = jnp.pad(x, ((0, nt - m), (0, 0)))
    one = jnp.ones((1,), jnp.int32)
    meta = moe_mgpu._meta(jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32), one)
    n = w8t.shape[0]
    gemm = functools.partial(
        moe_mgpu._grouped_gemm, glu=False, block_tokens=nt, num_out_rows=nt,
        num_ctas=moe_mgpu._device_sms() if interpret is None else 4, max_stages=8,
        row_tiles=2 if n % 128 == 0 and n // 128 >= 132 else 1, interpret=interpret)
    if a8 and nt <= 8:
        y = gemm(meta, w8t[None], s[None], xr, None, quantize_b=True, shared_rows=True)
    elif a8:
        xq, xs = moe.quantize_rows(xr)
        y = gemm(meta, w8t[None], s[None], xq, xs)
    else:
        y = gemm(meta, w8t[None], s[None], xr, None)
    assert not isinstance(y, tuple)
    return y


def _w8a8(x: jax.Array, w8: jax.Array, s: jax.Array) -> jax.Array:
    xq, xs = moe.quantize_rows(x)
    y = jnp.dot(xq, w8, preferred_element_type=jnp.float32)
    return (y * xs[:, None] * s).astype(x.dtype)


def measure(f, args, iters: int) -> tuple[float, dict[str, float], int]:
    """Median us per call (CUPTI sum of kernel durations), the per-kernel breakdown and the
    number of kernels per call."""
    from jax.experimental.mosaic.gpu import profiler

    _, per_iter = profiler.measure(f, aggregate=False, iterations=max(iters, 2))(*args)
    if not per_iter:
        raise RuntimeError("CUPTI returned no kernel timings")
    totals = [sum(t for _, t in ks) for ks in per_iter]
    names: dict[str, list[float]] = {}
    for ks in per_iter:
        for n, t in ks:
            names.setdefault(n[:60], []).append(t)
    breakdown = {n: round(sum(v) / len(per_iter) * 1e3, 2) for n, v in names.items()}
    return statistics.median(totals) * 1e3, breakdown, len(per_iter[0])


def copy_gbps() -> float:
    x = jax.random.bits(jax.random.key(1), (2**28,), jnp.uint32)  # 1 GiB
    us, _, _ = measure(jax.jit(lambda a: a + jnp.uint32(1)), (x,), 10)
    return 2 * 2**30 / us / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="activation rows (decode batch)")
    p.add_argument("--layers", type=int, default=24, help="distinct weight matrices per timed call")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {','.join(SHAPES)}")
    p.add_argument("--variants", default=",".join(ALL_VARIANTS), help=f"comma list of {','.join(ALL_VARIANTS)}")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=400.0, help="stop starting new cases after this")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if jax.default_backend() != "gpu":
        sys.exit("bench_decode_gemm.py needs a GPU (it measures XLA's GPU GEMM tilings)")
    t0 = time.time()
    info = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "layers": args.layers,
            "rows": args.rows, "copy_GBps": round(copy_gbps(), 1)}
    print(json.dumps(info), flush=True)
    results: list[dict[str, Any]] = []
    for name in args.shapes.split(","):
        K, N = SHAPES[name]
        n_layers = min(args.layers, max(2, int(6e9 // (K * N * 2))))  # <= ~6 GB of weights
        ws = jax.random.normal(jax.random.key(2), (n_layers, K, N), jnp.bfloat16) * 0.02
        w8: tuple[jax.Array, jax.Array, jax.Array] | None = None  # ([L, K, N] e4m3, scales, [L, N, K] e4m3)
        for m in args.rows:
            x = jax.random.normal(jax.random.key(3), (m, K), jnp.bfloat16)
            for label in args.variants.split(","):
                if time.time() - t0 > args.budget_s:
                    print(f"budget reached: skipping {name} M={m} {label}", flush=True)
                    continue
                row: dict[str, Any] = {"gemm": name, "M": m, "K": K, "N": N, "variant": label, "layers": n_layers}
                try:
                    wbytes = K * N * 2
                    call_args: tuple[Any, ...] = (x, ws)
                    if label in FP8_VARIANTS:
                        if w8 is None:
                            w8 = _fp8_weights(ws)
                        if label.startswith("mgpu"):
                            a8 = label == "mgpu_w8a8"
                            f = jax.jit(lambda x, w, s, a8=a8: [_mgpu(x, w[i], s[i], a8) for i in range(w.shape[0])])
                            call_args = (x, w8[2], w8[1])
                        else:
                            fn = _w8a16 if label == "xla_w8a16" else _w8a8
                            f = jax.jit(lambda x, w, s, fn=fn: [fn(x, w[i], s[i]) for i in range(w.shape[0])])
                            call_args = (x, w8[0], w8[1])
                        wbytes = K * N
                    elif label in GEMV_ROWS_VARIANTS:
                        st = GEMV_ROWS_VARIANTS[label]
                        row["stages"] = st
                        # outputs stay padded to 8 rows, as the model takes them (no slice kernel)
                        f = jax.jit(lambda x, w, st=st: [gemv_mgpu.gemv_rows(x, w[i], None, stages=st)[0]
                                                         for i in range(w.shape[0])])
                    elif label in GEMV_VARIANTS:
                        sp = max(1, int(gemv_mgpu.default_splits(K, N) * GEMV_VARIANTS[label]))
                        sp = min(sp, K // gemv_mgpu.BLOCK_K)
                        row["splits"] = sp
                        f = jax.jit(lambda x, w, sp=sp: [gemv_mgpu.gemv(x, w[i], splits=sp)
                                                         for i in range(w.shape[0])])
                    else:
                        f = jax.jit(lambda x, w: [x @ w[i] for i in range(w.shape[0])],
                                    compiler_options=VARIANTS[label] or None)
                    ref = (x.astype(jnp.float32) @ ws[0].astype(jnp.float32))
                    out0 = f(*call_args)[0][:m]
                    row["max_rel_err"] = float(jnp.abs(out0.astype(jnp.float32) - ref).max() / jnp.abs(ref).max())
                    us, kernels, launches = measure(f, call_args, args.iters)
                    per = us / n_layers
                    row.update(us=round(per, 2), GBps=round(wbytes / per / 1e3, 1),
                               of_copy=round(wbytes / per / 1e3 / info["copy_GBps"], 3),
                               kernels_per_gemm=round(launches / n_layers, 2),
                               kernels={k: v for k, v in list(kernels.items())[:4]})
                except Exception as e:  # noqa: BLE001 - record and continue
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                    traceback.print_exc(limit=1)
                results.append(row)
                print(f"{name:10s} M={m:<3d} {label:22s} " + (
                    f"{row['us']:8.2f} us  {row['GBps']:7.1f} GB/s ({row['of_copy']:.0%})  err {row['max_rel_err']:.1e}"
                    f"  kernels/GEMM {row['kernels_per_gemm']}" if "us" in row else row.get("error", "")),
                    flush=True)
        del ws, w8
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"info": info, "results": results, "wall_s": round(time.time() - t0, 1)}, fh, indent=1)


if __name__ == "__main__":
    main()
