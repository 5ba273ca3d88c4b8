#!/usr/bin/env python3
"""Benchmark the paged-attention kernels (decode, prefill, KV write) on the GPU.

    PYTHONPATH=. python3 tools/bench_attention.py --out $OUT/attention.json   # GPU, the full grid
    PYTHONPATH=. python3 tools/bench_attention.py --decode-cases 1x128,1x512 # GPU, a part of the grid
    PYTHONPATH=. python3 tools/bench_attention.py --quick                     # GPU, a few cases
    PYTHONPATH=. python3 tools/bench_attention.py --cpu-smoke                 # CPU, interpreted, tiny
    PYTHONPATH=. python3 tools/bench_attention.py --tune [--tune-prefill]     # GPU, kernel variants only

Prints the device, jax version and settings, measures two ceilings once (device-to-device copy
bandwidth, bytes read + written; bf16 and fp8 8192^3 matmul), then for every case compiles the
kernel, checks it against the jnp reference at the same shapes (max abs / rel error), and times
it next to the reference run through XLA and, for decode, JAX's stock Triton `paged_attention`
(bf16 pages in its own [Hkv, P, 16, D] layout; it has no FP8 path). A failing case or
implementation is recorded and the run continues.

Inputs never repeat within a timed program: each program calls the implementation on R input
sets (unrolled in one jit; each set has its own q and its own pages of one large pool, random
non-zero values), with R * bytes >= ~2x the 50 MB L2 where R <= 16 allows. `--tune` loops one
kernel instance over the R sets instead (`lax.map`: compiled once) and counts only the Pallas
kernel's time (the loop's slicing copies are not the kernel's cost). Kernel time comes from
CUPTI (jax.experimental.mosaic.gpu.profiler.measure: per call, the sum of the durations of the
kernels it launches, launch gaps excluded; for the KV write only kernels named like ours are
summed, which drops XLA's copy of the non-donated pool); if CUPTI fails, the median of
host-timed calls (block_until_ready; includes dispatch) is reported and the method column says so.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, installed or not

from kestrel_jax.pallas import paged_attention as pa  # noqa: E402
from kestrel_jax.pallas import paged_attention_mgpu as pm  # noqa: E402
from kestrel_jax.pallas import paged_attention_prefill_mgpu as pp  # noqa: E402

L2_BYTES = 50 * 2**20
D = 64
# Heads of the benchmarked layer (MD3: 32 x 64, no GQA); --cpu-smoke shrinks them.
DIMS = {"h": 32, "hkv": 32}
SM_SCALE = 0.125
DECODE_B = [1, 4, 8, 32, 64, 128]
DECODE_KV = [128, 512, 740, 1024, 2048, 4096]
# Kestrel's published H100 figures (us per layer call), KERNELS.md section 3.
TARGETS_US = {("decode", 1, 740): 9.6, ("decode", 4, 740): 17.1, ("decode", 8, 512): 10.0,
              ("decode", 32, 128): 11.8, ("prefill", 1, 740): 19.9, ("prefill", 1, 1024): 27.3,
              ("write", 1, 0): 3.7, ("write", 1024, 0): 8.6}


# ------------------------------------------------------------------------------ timing


def time_calls(f: Callable, args: tuple, r: int, iters: int, cpu: bool, name_filter: str | None = None,
               warm: bool = True) -> tuple[float, str]:
    """Median microseconds per single call of a program that makes r calls. Host timing first runs
    it once untimed unless `warm` is False (the caller ran it already: on the CPU, interpreted
    kernels make every run cost seconds)."""
    if not cpu:
        try:
            from jax.experimental.mosaic.gpu import profiler

            iters = max(iters, 2)  # always a list of per-iteration kernel lists
            _, per_iter = profiler.measure(f, aggregate=False, iterations=iters)(*args)
            if per_iter:
                totals = []
                matched = True
                names: dict[str, list[float]] = {}
                for kernels in per_iter:
                    for n, t in kernels:
                        names.setdefault(n, []).append(t)
                    mine = [t for n, t in kernels if name_filter and name_filter in n]
                    matched &= bool(mine)
                    totals.append(sum(mine) if mine else sum(t for _, t in kernels))
                how = "cupti" if not name_filter or matched else "cupti-all:" + ",".join(n for n, _ in per_iter[0])
                # Per kernel name: us per call (summed over the iteration's launches, median of iterations).
                BREAKDOWN[0] = {n[:80]: round(sum(v) / len(per_iter) * 1e3 / r, 2) for n, v in names.items()}
                return statistics.median(totals) * 1e3 / r, how[:300]
        except Exception as e:  # noqa: BLE001 - report and fall back
            print(f"  (CUPTI failed: {type(e).__name__}: {e}; host timing)", file=sys.stderr)
    if warm:
        jax.block_until_ready(f(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6 / r, "host"


BREAKDOWN: list[dict[str, float]] = [{}]
# --tune: loop over the rotated inputs inside one program (one kernel instance, compiled once) and
# time the Pallas kernel alone (the loop's slicing copies are not the kernel's cost).
LOOP_ROTATIONS = [False]  # the last CUPTI measurement's kernels, us per call


def rotations(set_bytes: int, cap: int = 16) -> int:
    if DIMS["h"] < 32:  # --cpu-smoke: interpreted calls are slow, and there is no L2 to defeat
        return 1
    return max(1, min(cap, math.ceil(2 * L2_BYTES / max(set_bytes, 1))))


def ceilings(cpu: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if cpu:
        return out
    n = 2**30  # 1 GiB per buffer
    x = jax.random.bits(jax.random.key(1), (n // 4,), jnp.uint32)
    copy = jax.jit(lambda a: a + jnp.uint32(1))  # read + write 1 GiB each
    us, how = time_calls(copy, (x,), 1, 10, cpu)
    out["copy_GBps"] = 2 * n / us / 1e3
    out["copy_method"] = how
    del x
    for name, dt in (("bf16", jnp.bfloat16), ("fp8", jnp.float8_e4m3fn)):
        try:
            a = (jax.random.normal(jax.random.key(2), (8192, 8192), jnp.float32) * 0.1).astype(dt)
            b = (jax.random.normal(jax.random.key(3), (8192, 8192), jnp.float32) * 0.1).astype(dt)
            mm = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
            us, _ = time_calls(mm, (a, b), 1, 10, cpu)
            out[f"matmul_{name}_TFLOPs"] = 2 * 8192**3 / us / 1e6
        except Exception as e:  # noqa: BLE001
            out[f"matmul_{name}_error"] = f"{type(e).__name__}: {e}"[:300]
    return out


# ------------------------------------------------------------------------------ inputs


def random_pool(key: jax.Array, pages: int, page: int, dtype) -> tuple[jax.Array, jax.Array]:
    """Random non-zero pool. FP8: random e4m3 bytes with the top exponent bit cleared
    (|x| < 2, never NaN); bf16: N(0, 1)."""
    shape = (pages, DIMS["hkv"], page, D)
    out = []
    for k in jax.random.split(key, 2):
        if pa.is_fp8(dtype):
            bits = jax.random.bits(k, shape, jnp.uint8) & jnp.uint8(0xBF)
            bits = jnp.where(bits == 0, jnp.uint8(0x38), bits)  # no exact zeros
            out.append(jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn))
        else:
            out.append(jax.random.normal(k, shape, dtype))
    return out[0], out[1]


def decode_inputs(rng: np.random.Generator, b: int, kv: int, page: int, dtype, r: int):
    maxp = -(-kv // page)
    maxp_pad = -(-maxp // 4) * 4  # the kernels TMA a table row: keep it 16-byte aligned
    pages = r * b * maxp + 1
    k_pages, v_pages = random_pool(jax.random.key(int(rng.integers(2**31))), pages, page, dtype)
    perm = rng.permutation(pages)[: r * b * maxp].reshape(r, b, maxp)
    tables = np.zeros((r, b, maxp_pad), np.int32)
    tables[:, :, :maxp] = perm
    qs = jax.random.normal(jax.random.key(int(rng.integers(2**31))), (r, b, DIMS["h"], D), jnp.bfloat16)
    lens = jnp.full((b,), kv, jnp.int32)
    return k_pages, v_pages, jnp.asarray(tables), qs, lens


def check(out: jax.Array, ref: jax.Array) -> dict[str, float]:
    o = np.asarray(out.astype(jnp.float32))
    r = np.asarray(ref.astype(jnp.float32))
    err = np.abs(o - r)
    return {"max_abs_err": float(np.nanmax(err)) if err.size else 0.0,
            "max_rel_err": float(np.nanmax(err) / max(np.abs(r).max(), 1e-30)) if err.size else 0.0,
            "nan": int(np.isnan(o).sum())}


def layer_pools(rng: np.random.Generator, k_pages: jax.Array, v_pages: jax.Array, tables: np.ndarray, maxp: int
                ) -> tuple[list[jax.Array], list[jax.Array], jax.Array]:
    """The rotations re-laid as the engine's layers are: one page table shared by all of them (a
    scrambled one), each rotation's pages in a pool of its own at that table's ids (rotation i's
    pool holds at shared[s, p] what tables[i] points at for [s, p]). The engine prepares a step's
    page table and lengths once for its 24 layers; a program of r calls over these pools does the
    same, so its time per call is one layer's."""
    r, b = tables.shape[:2]
    n_loc = b * maxp + 1
    shared = np.zeros((b, tables.shape[2]), np.int32)
    shared[:, :maxp] = rng.permutation(n_loc)[: b * maxp].reshape(b, maxp)
    kps, vps = [], []
    for i in range(r):
        src = np.zeros(n_loc, np.int32)
        src[shared[:, :maxp].reshape(-1)] = tables[i, :, :maxp].reshape(-1)
        kps.append(jnp.take(k_pages, jnp.asarray(src), axis=0))
        vps.append(jnp.take(v_pages, jnp.asarray(src), axis=0))
    return kps, vps, jnp.asarray(shared)


LAYER = "layer"  # impl name: the kernel as the engine's layers call it (see `layer_pools`)


def parse_cases(text: str) -> list[tuple[int, int]]:
    """--decode-cases: 'BxKV,BxKV,...' -> [(B, KV), ...]."""
    try:
        cases = [(int(b), int(kv)) for b, kv in (c.strip().split("x") for c in text.split(","))]
    except ValueError:
        raise SystemExit(f"--decode-cases: expected 'BxKV,BxKV,...' (e.g. 32x128,8x512), got {text!r}") from None
    if any(b < 1 or kv < 1 for b, kv in cases):
        raise SystemExit(f"--decode-cases: batch and KV length must be >= 1, got {text!r}")
    return cases


# ------------------------------------------------------------------------------ decode


def stock_decode(q, k_hmajor, v_hmajor, table16, lens, *, k_splits):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
    return paged_attention(q, k_hmajor, v_hmajor, table16, lens, pages_per_compute_block=8, k_splits=k_splits)


def bench_decode(rng, b, kv, page, dtype, impls, iters, cpu, kernel_kw, ks, vs) -> dict[str, Any]:
    itemsize = jnp.dtype(dtype).itemsize
    kv_bytes = b * kv * DIMS["hkv"] * D * 2 * itemsize
    r = rotations(kv_bytes)
    k_pages, v_pages, tables, qs, lens = decode_inputs(rng, b, kv, page, dtype, r)
    case: dict[str, Any] = {"op": "decode", "B": b, "KV": kv, "page": page, "dtype": jnp.dtype(dtype).name,
                            "rotations": r, "bytes": kv_bytes, "impls": {}}
    ref_fn = functools.partial(pa.decode_attention_ref, sm_scale=SM_SCALE)
    ref_out = jax.jit(ref_fn)(qs[0], k_pages, v_pages, lens, tables[0], ks, vs)
    for name, kw in impls.items():
        try:
            if name == "stock_bf16":
                res = _stock_decode_case(rng, b, kv, iters, cpu)
                case["impls"][name] = res
                continue
            f = ref_fn if name == "xla_ref" else functools.partial(pm.decode_attention_kernel, sm_scale=SM_SCALE,
                                                                   **kernel_kw, **kw)
            args: tuple[Any, ...] = (k_pages, v_pages, tables, qs, lens)
            if name == LAYER:
                kps, vps, shared = layer_pools(rng, k_pages, v_pages, np.asarray(tables), -(-kv // page))
                args = (kps, vps, shared, qs, lens)
                prog = jax.jit(lambda kp, vp, t, q, n, f=f: tuple(f(q[i], kp[i], vp[i], n, t, ks, vs)
                                                                  for i in range(r)))
            elif LOOP_ROTATIONS[0]:
                prog = jax.jit(lambda kp, vp, t, q, n, f=f: jax.lax.map(
                    lambda x: f(x[1], kp, vp, n, x[0], ks, vs), (t, q)))
            else:
                prog = jax.jit(lambda kp, vp, t, q, n, f=f: tuple(f(q[i], kp, vp, n, t[i], ks, vs)
                                                                  for i in range(r)))
            t0 = time.time()
            # (to stderr, where --ptxas-info's report of this compile follows it)
            print(f"  decode {b}x{kv} {name}: compiling", file=sys.stderr, flush=True)
            outs = jax.block_until_ready(prog(*args))
            res = {"compile_s": round(time.time() - t0, 2)}
            if name != "xla_ref":
                res.update(check(outs[0], ref_out))
            BREAKDOWN[0] = {}
            us, how = time_calls(prog, args, r, iters, cpu, warm=not cpu,
                                 name_filter="kestrel" if LOOP_ROTATIONS[0] and name != "xla_ref" else None)
            if name == LAYER:
                del args, kps, vps
            res.update({"us": us, "method": how, "GBps": kv_bytes / us / 1e3, "kernels": BREAKDOWN[0]})
            case["impls"][name] = res
        except Exception as e:  # noqa: BLE001 - record and continue
            case["impls"][name] = {"error": f"{type(e).__name__}: {e}"[:400]}
            traceback.print_exc(limit=2)
    return case


def _stock_decode_case(rng, b, kv, iters, cpu) -> dict[str, Any]:
    if cpu:
        return {"error": "skipped on CPU"}
    page = 16
    maxp = -(-kv // page)
    maxp = -(-maxp // 8) * 8  # pages_per_compute_block = 8
    k_splits = max(s for s in range(1, 17) if (maxp // 8) % s == 0)
    kv_bytes = b * kv * DIMS["hkv"] * D * 2 * 2
    r = rotations(kv_bytes)
    pages = r * b * maxp
    kp, vp = random_pool(jax.random.key(int(rng.integers(2**31))), pages, page, jnp.bfloat16)
    kp, vp = kp.transpose(1, 0, 2, 3), vp.transpose(1, 0, 2, 3)  # its layout: [Hkv, P, S, D]
    tables = jnp.asarray(rng.permutation(pages).reshape(r, b, maxp).astype(np.int32))
    qs = jax.random.normal(jax.random.key(int(rng.integers(2**31))), (r, b, DIMS["h"], D), jnp.bfloat16)
    lens = jnp.full((b,), kv, jnp.int32)
    f = functools.partial(stock_decode, k_splits=k_splits)
    prog = jax.jit(lambda kp, vp, t, q, n: tuple(f(q[i], kp, vp, t[i], n) for i in range(r)))
    jax.block_until_ready(prog(kp, vp, tables, qs, lens))
    us, how = time_calls(prog, (kp, vp, tables, qs, lens), r, iters, cpu)
    return {"us": us, "method": how, "GBps": kv_bytes / us / 1e3, "k_splits": k_splits}


# ----------------------------------------------------------------------------- prefill


def prefill_pairs(q_lens, cached, prefix) -> int:
    """Number of (query, key) pairs the mask allows."""
    total = 0
    for n, c, pre in zip(q_lens, cached, prefix, strict=True):
        pos = np.arange(c, c + n)
        lim = np.where(pos < pre, np.maximum(pos + 1, pre), pos + 1)
        total += int(np.minimum(lim, c + n).sum())
    return total


def bench_prefill(rng, label, q_lens, cached, prefix, page, dtype, impls, iters, cpu, kernel_kw, ks, vs
                  ) -> dict[str, Any]:
    n_heads = DIMS["h"]
    b = len(q_lens)
    kvl = np.array(q_lens) + np.array(cached)
    maxp = -(-int(kvl.max()) // page)
    maxp_pad = -(-maxp // 4) * 4
    T = int(sum(q_lens))
    set_bytes = int(kvl.sum()) * DIMS["hkv"] * D * 2 * jnp.dtype(dtype).itemsize + T * n_heads * D * 4
    r = rotations(set_bytes, cap=8)
    pages = r * b * maxp + 1
    k_pages, v_pages = random_pool(jax.random.key(int(rng.integers(2**31))), pages, page, dtype)
    perm = rng.permutation(pages)[: r * b * maxp].reshape(r, b, maxp)
    tables = np.zeros((r, b, maxp_pad), np.int32)
    tables[:, :, :maxp] = perm
    tables_j = jnp.asarray(tables)
    qs = jax.random.normal(jax.random.key(int(rng.integers(2**31))), (r, T, n_heads, D), jnp.bfloat16)
    cu = jnp.asarray(np.r_[0, np.cumsum(q_lens)].astype(np.int32))
    lens = jnp.asarray(kvl.astype(np.int32))
    pre = jnp.asarray(np.array(prefix, np.int32))
    flops = 4 * D * n_heads * prefill_pairs(q_lens, cached, prefix)
    case: dict[str, Any] = {"op": "prefill", "case": label, "B": b, "T": T, "page": page,
                            "dtype": jnp.dtype(dtype).name, "rotations": r, "flops": flops, "impls": {}}
    ref_fn = functools.partial(pa.prefill_attention_ref, sm_scale=SM_SCALE)
    ref_out = jax.jit(ref_fn)(qs[0], k_pages, v_pages, cu, lens, tables_j[0], pre, ks, vs)
    for name, kw in impls.items():
        try:
            f = ref_fn if name == "xla_ref" else functools.partial(pp.prefill_attention_kernel, sm_scale=SM_SCALE,
                                                                   **kernel_kw, **kw)
            args: tuple[Any, ...] = (k_pages, v_pages, tables_j, qs)
            if name == LAYER:
                kps, vps, shared = layer_pools(rng, k_pages, v_pages, tables, maxp)
                args = (kps, vps, shared, qs)
                prog = jax.jit(lambda kp, vp, t, q, f=f: tuple(f(q[i], kp[i], vp[i], cu, lens, t, pre, ks, vs)
                                                               for i in range(r)))
            elif LOOP_ROTATIONS[0]:  # one kernel instance in a loop: compiled once, timed alone
                prog = jax.jit(lambda kp, vp, t, q, f=f: jax.lax.map(
                    lambda x: f(x[1], kp, vp, cu, lens, x[0], pre, ks, vs), (t, q)))
            else:
                prog = jax.jit(lambda kp, vp, t, q, f=f: tuple(f(q[i], kp, vp, cu, lens, t[i], pre, ks, vs)
                                                               for i in range(r)))
            t0 = time.time()
            print(f"  {label} {name}: compiling", file=sys.stderr, flush=True)
            outs = jax.block_until_ready(prog(*args))
            res: dict[str, Any] = {"compile_s": round(time.time() - t0, 2)}
            print(f"  {label} {name}: ran once after {res['compile_s']}s", file=sys.stderr, flush=True)
            if name != "xla_ref":
                res.update(check(outs[0], ref_out))
            BREAKDOWN[0] = {}
            us, how = time_calls(prog, args, r, iters, cpu, warm=not cpu,
                                 name_filter="kestrel" if LOOP_ROTATIONS[0] and name != "xla_ref" else None)
            if name == LAYER:
                del args, kps, vps
            res.update({"us": us, "method": how, "TFLOPs": flops / us / 1e6, "kernels": BREAKDOWN[0]})
            case["impls"][name] = res
        except Exception as e:  # noqa: BLE001
            case["impls"][name] = {"error": f"{type(e).__name__}: {e}"[:400]}
            traceback.print_exc(limit=2)
    return case


# ------------------------------------------------------------------------------- write


def bench_write(rng, t, page, dtype, iters, cpu, kernel_kw, ks, vs) -> dict[str, Any]:
    pages = max(64, 2 * t // page + 8)
    k_pages, v_pages = random_pool(jax.random.key(int(rng.integers(2**31))), pages, page, dtype)
    r = 8
    ks_rows = jax.random.normal(jax.random.key(int(rng.integers(2**31))), (r, t, DIMS["hkv"], D), jnp.bfloat16)
    slots = jnp.asarray(np.stack([rng.permutation(pages * page)[:t] for _ in range(r)]).astype(np.int32))
    case: dict[str, Any] = {"op": "write", "T": t, "page": page, "dtype": jnp.dtype(dtype).name, "impls": {}}
    for name in ("kernel", "xla_ref"):
        try:
            f = pa.write_kv_ref if name == "xla_ref" else functools.partial(pm.write_kv_kernel, **kernel_kw)

            def prog(kp, vp, rows, sl, f=f):
                for i in range(r):
                    kp, vp = f(kp, vp, rows[i], rows[i], sl[i], ks, vs)
                return kp, vp

            prog_j = jax.jit(prog)
            got = jax.block_until_ready(prog_j(k_pages, v_pages, ks_rows, slots))
            res: dict[str, Any] = {}
            if name == "kernel":
                want = jax.jit(functools.partial(prog, f=pa.write_kv_ref))(k_pages, v_pages, ks_rows, slots)
                res["exact"] = bool(np.array_equal(np.asarray(got[0].astype(jnp.float32)),
                                                   np.asarray(want[0].astype(jnp.float32))))
            flt = None if name == "xla_ref" else "kestrel_write_kv"
            us, how = time_calls(prog_j, (k_pages, v_pages, ks_rows, slots), r, iters, cpu, name_filter=flt,
                                 warm=not cpu)
            res.update({"us": us, "method": how})
            case["impls"][name] = res
        except Exception as e:  # noqa: BLE001
            case["impls"][name] = {"error": f"{type(e).__name__}: {e}"[:400]}
            traceback.print_exc(limit=2)
    return case


# -------------------------------------------------------------------------------- main


def case_key(case: dict[str, Any]) -> tuple[str, int, int]:
    if case["op"] == "decode":
        return ("decode", case["B"], case["KV"])
    if case["op"] == "prefill":
        return ("prefill", case["B"], case["T"])
    return ("write", case["T"], 0)


def fmt_case(case: dict[str, Any], ceil: dict[str, Any]) -> str:
    op = case["op"]
    if op == "decode":
        head = f"decode  B={case['B']:<4d} KV={case['KV']:<5d} page={case['page']:<3d} {case['dtype']:<14s}"
    elif op == "prefill":
        head = f"prefill {case['case']:<22s} page={case['page']:<3d} {case['dtype']:<14s}"
    else:
        head = f"write   T={case['T']:<5d}            page={case['page']:<3d} {case['dtype']:<14s}"
    parts = []
    for name, res in case["impls"].items():
        if "error" in res:
            parts.append(f"{name}: ERROR")
            continue
        s = f"{name}: {res['us']:8.1f}us"
        if "GBps" in res:
            frac = res["GBps"] / ceil["copy_GBps"] if ceil.get("copy_GBps") else float("nan")
            s += f" {res['GBps']:6.0f}GB/s ({frac:4.0%})"
        if "TFLOPs" in res:
            peak = ceil.get("matmul_bf16_TFLOPs")
            frac = res["TFLOPs"] / peak if peak else float("nan")
            s += f" {res['TFLOPs']:5.0f}TF/s ({frac:4.0%})"
        if "max_rel_err" in res:
            s += f" err={res['max_rel_err']:.1e}"
        if res.get("method") == "host":
            s += " [host]"
        parts.append(s)
    tgt = TARGETS_US.get(case_key(case))
    return head + " | " + " | ".join(parts) + (f" | Kestrel {tgt}us" if tgt and case["page"] == 64 else "")


def print_summary(cases: list[dict[str, Any]], ceil: dict[str, Any]) -> None:
    """One line per Kestrel target and per failure, printed last (the end of the log is what survives)."""
    print("\n== summary: kernel vs Kestrel's published H100 figure (same page size as the main grid) ==")
    for c in cases:
        key = case_key(c)
        tgt = TARGETS_US.get(key)
        res = c["impls"].get("kernel", {})
        big = c["op"] == "decode" and c.get("B") == 64 and c.get("KV") == 2048
        if (tgt or big) and "us" in res and c["page"] == PAGE_OF_GRID[0] and c["dtype"] == "float8_e4m3fn":
            extra = ""
            if big and ceil.get("copy_GBps"):
                extra = f" = {res['GBps'] / ceil['copy_GBps']:.0%} of copy BW (target >= 70%)"
            # The verdict is on the layer call (`layer_pools`: the rotations share one page table and
            # lengths, prepared once, as a step's 24 layers do); "own prep" is the call with this
            # harness's argument preparation (own_buffer clamps of the lengths and page table) per
            # call, every rotation having its own table; the kernel alone is printed beside them.
            lay = c["impls"].get(LAYER, {})
            call = lay["us"] if "us" in lay else res["us"]
            verdict = "" if tgt is None else ("  OK" if call <= tgt else "  SLOWER")
            kern = sum(v for k, v in (res.get("kernels") or {}).items() if k.startswith("kestrel"))
            if tgt:
                verdict += f" (own prep {res['us']:.1f} us" + (
                    f", kernel alone {kern:.1f} us: {'OK' if kern <= tgt else 'SLOWER'})" if kern else ")")
            print(f"  {key}: {call:.1f} us{extra}" + (f" vs {tgt} us{verdict}" if tgt else "")
                  + (f"  kernels/call: {lay.get('kernels') or res.get('kernels')}"
                     if lay.get("kernels") or res.get("kernels") else ""))
        for name, r in c["impls"].items():
            if "error" in r or r.get("nan"):
                print(f"  FAILED {key} {name}: {r.get('error', 'NaN in output')}"[:300])


PAGE_OF_GRID = [64]


def run(args: argparse.Namespace) -> dict[str, Any]:
    cpu = args.cpu_smoke
    rng = np.random.default_rng(args.seed)
    iters = 1 if cpu else args.iters  # on the CPU: a check that every case runs, not a timing
    kernel_kw: dict[str, Any] = {"interpret": True} if cpu else {}
    ks, vs = jnp.float32(0.05), jnp.float32(0.04)
    if cpu:
        DIMS.update(h=4, hkv=2)
    info: dict[str, Any] = {
        "device": str(jax.devices()[0].device_kind), "platform": jax.default_backend(), "jax": jax.__version__,
        "mode": "cpu-smoke" if cpu else ("quick" if args.quick else "full"), "iterations": iters,
        "heads": DIMS["h"], "kv_heads": DIMS["hkv"], "head_dim": D, "sm_scale": SM_SCALE, "page": args.page,
        "seed": args.seed}
    print(json.dumps(info, indent=1))
    ceil = ceilings(cpu)
    print("ceilings:", json.dumps(ceil))
    cases: list[dict[str, Any]] = []
    skipped: list[str] = []
    t_start = time.time()

    def emit(make: Callable[[], dict[str, Any]], label: str, optional: bool = False) -> None:
        """Run one case; optional sweeps are skipped once the time budget is spent."""
        if optional and time.time() - t_start > args.budget_s:
            skipped.append(label)
            return
        case = make()
        cases.append(case)
        print(fmt_case(case, ceil), flush=True)
        if case.get("impls", {}).get("kernel", {}).get("kernels"):
            print(f"    kernels/call: {case['impls']['kernel']['kernels']}", flush=True)
        if args.out:  # after every case: a run cut short by its time limit keeps what it measured
            with open(args.out, "w") as f:
                json.dump({**info, "ceilings": ceil, "cases": cases, "partial": True}, f, indent=1, default=str)

    fp8 = jnp.float8_e4m3fn
    page = 8 if cpu else args.page
    PAGE_OF_GRID[0] = page
    full = not cpu and not args.quick
    if cpu:
        dec_grid = [(2, 40)]
        pre_cases = [("image+prompt 50+6", [56], [0], [50])]
    elif args.quick:
        dec_grid = [(1, 740), (8, 512), (32, 128), (64, 2048)]
        pre_cases = [("image 740", [740], [0], [730])]
    elif args.targets:
        dec_grid = [(1, 740), (4, 740), (8, 512), (32, 128), (64, 2048)]
    else:
        dec_grid = [(b, kv) for b in DECODE_B for kv in DECODE_KV]
    if args.decode_cases and not args.tune:  # a part of the grid (e.g. one of several device calls)
        dec_grid = parse_cases(args.decode_cases)
    if not cpu and not args.quick:
        pre_cases = [("image 740", [740], [0], [730]), ("image+prompt 1024", [1024], [0], [730]),
                     ("16 x image 740", [740] * 16, [0] * 16, [730] * 16),
                     ("prompt 10 after cached 730", [10], [730], [730])]
    # The stock Triton kernel compiles slowly: run it where KERNELS.md has reference points.
    stock_at = {(1, 740), (4, 740), (8, 512), (32, 128), (32, 1024), (64, 2048), (128, 1024)}

    if args.tune:  # kernels only: decode and (--tune-prefill) prefill variants at the target cases
        LOOP_ROTATIONS[0] = True
        # (Two warpgroups per CTA splitting a CTA's tiles, and several KV heads per CTA, were
        # tried here on 2026-11-24: neither was faster; BENCHMARKS.md has the figures.)
        dec_variants: dict[str, dict[str, Any]] = {"kernel": {}, "splits=1": {"num_splits": 1},
                                                   "splits=2": {"num_splits": 2},
                                                   # 64-row tiles always (the default picks 16-row tiles in an
                                                   # eight-slot ring for large grids over short tables:
                                                   # `decode_tile_plan`)
                                                   "t64": {"tile_rows": 64},
                                                   # fewer slots (less SMEM per CTA)
                                                   "d2": {"depth": 2},
                                                   # 16-row tiles: 8 channels of one row per thread
                                                   "t16": {"tile_rows": 16}, "t16,d8": {"tile_rows": 16, "depth": 8},
                                                   "t16,d4": {"tile_rows": 16, "depth": 4}}
        # (Several KV heads per CTA on one load ring were slower at every case here in the fortieth
        # session: built, measured and removed; BENCHMARKS.md has the figures.)
        dec_cases = [(8, 512), (32, 128), (8, 64), (1, 740), (4, 740), (64, 2048), (128, 1024)]
        if args.decode_cases:
            dec_cases = parse_cases(args.decode_cases)
        pre_variants: dict[str, dict[str, Any]] = {
            "kernel": {},  # defaults
            "old": {"pingpong": False, "acc_in_place": False},  # the third session's schedule
            "inplace": {"pingpong": False},
            "R128": {"wg_rows": 128, "registers": (232, 40)},
            "R128,nopp": {"wg_rows": 128, "registers": (232, 40), "pingpong": False},
            "2wg,r208/88": {"registers": (208, 88)},
            "R128,r216/72": {"wg_rows": 128, "registers": (216, 72)},
            # three or four 64-row consumers: a 740-token head in 4 (3) blocks, 128 (96) CTAs
            "3wg,R64": {"num_consumers": 3, "wg_rows": 64, "block_k": 64},
            "3wg,R64,r152/56": {"num_consumers": 3, "wg_rows": 64, "registers": (152, 56)},
            "3wg,R64,op3": {"num_consumers": 3, "wg_rows": 64, "n_op": 3, "block_k": 64},
            "4wg,R64": {"num_consumers": 4, "wg_rows": 64},
            "4wg,R64,r96/96": {"num_consumers": 4, "wg_rows": 64, "registers": (96, 96)},  # the even share
            "4wg,R64,r104/64": {"num_consumers": 4, "wg_rows": 64, "registers": (104, 64)},
            "4wg,R64,r112/32": {"num_consumers": 4, "wg_rows": 64, "registers": (112, 32)},
            # every warpgroup runs all of its CTA's key tiles (before: skip_tiles, the default since
            # the fortieth session, only waits for and releases those past its own rows' limit)
            "noskip": {"skip_tiles": False},
            # 128-key tiles (half the key-loop trips; S is 64 x 128 f32 per M tile: 64 registers a thread).
            # setmaxnreg: nc x consumer + producer <= (nc + 1) x cap, cap 128 (3 wg), 168 (2), 96 (4).
            # Slower on the H200 and dropped (fortieth session, 740 / 1024 / 16 x 740 us): 3 x 64 at
            # (152, 56) 21.5 / 44.2 / 295.3, 2 x 128 at (216, 72) 31.2 / 40.2 / 373.2, 4 x 64 at
            # (112, 32) 45.3 / 52.0 / 472.8 (spills). FA3's intra-warpgroup pipelining (tile t's S
            # issued with tile t-1's PV) was slower at every shape: built, measured and removed.
            "3wg,R64,bk128": {"num_consumers": 3, "wg_rows": 64, "block_k": 128},
            "3wg,R64,bk128,op3": {"num_consumers": 3, "wg_rows": 64, "block_k": 128, "n_op": 3},
            # a third TMA staging slot: 48 KiB of K/V in flight per CTA instead of 32
            "3wg,R64,bk128,st3": {"num_consumers": 3, "wg_rows": 64, "block_k": 128, "n_stage": 3},
            "4wg,R64,st3": {"num_consumers": 4, "wg_rows": 64, "n_stage": 3},
        }
        if args.tune_prefill_only:  # the defaults against the 64-row multi-consumer and 128-key-tile variants
            pre_variants = {k: v for k, v in pre_variants.items()
                            if k in ("kernel", "noskip") or "wg,R64" in k or "bk128" in k}
        if args.variants:  # only these (and the defaults), decode and prefill names alike
            wanted = args.variants.split(";")
            unknown = set(wanted) - set(pre_variants) - set(dec_variants)
            if unknown:
                raise SystemExit(f"--variants: unknown {sorted(unknown)}; known: prefill {sorted(pre_variants)}, "
                                 f"decode {sorted(dec_variants)}")
            pre_variants = {k: v for k, v in pre_variants.items() if k == "kernel" or k in wanted}
            dec_variants = {k: v for k, v in dec_variants.items() if k == "kernel" or k in wanted}
        for b, kv in [] if args.tune_prefill_only else dec_cases * args.repeat:
            emit(functools.partial(bench_decode, rng, b, kv, page, fp8, dec_variants, iters, cpu, kernel_kw, ks, vs),
                 f"decode tune {b}x{kv}", optional=True)
        for label, ql, cached, prefix in pre_cases[:3] if args.tune_prefill or args.tune_prefill_only else []:
            emit(functools.partial(bench_prefill, rng, label, ql, cached, prefix, page, fp8, pre_variants, iters,
                                   cpu, kernel_kw, ks, vs), f"prefill tune {label}", optional=True)
        print_summary(cases, ceil)
        info.update(cases=cases, ceilings=ceil, skipped_over_budget=skipped, wall_s=round(time.time() - t_start, 1))
        return info

    if args.splits_sweep:  # call times (the split merge included) of small batches by split count
        split_variants = {"default": {}, **{f"splits={n}": {"num_splits": n} for n in (1, 2, 3, 4, 6, 8)}}
        for b, kv in [(1, 740), (1, 1024), (1, 1250), (2, 740), (2, 1250), (4, 740), (4, 1250)]:
            emit(functools.partial(bench_decode, rng, b, kv, page, fp8, split_variants, iters, cpu, kernel_kw, ks, vs),
                 f"decode splits {b}x{kv}", optional=True)
        print_summary(cases, ceil)
        info.update(cases=cases, ceilings=ceil, skipped_over_budget=skipped, wall_s=round(time.time() - t_start, 1))
        return info

    if args.page_sweep:  # kernels only, at each page size
        for p in (16, 32, 64, 128):
            for b, kv in [(1, 740), (8, 512), (32, 128), (64, 2048)]:
                emit(functools.partial(bench_decode, rng, b, kv, p, fp8, {"kernel": {}}, iters, cpu, kernel_kw,
                                       ks, vs), f"decode page {p} {b}x{kv}", optional=True)
            emit(functools.partial(bench_prefill, rng, "image 740", [740], [0], [730], p, fp8, {"kernel": {}},
                                   iters, cpu, kernel_kw, ks, vs), f"prefill page {p}", optional=True)
        info.update(cases=cases, ceilings=ceil, skipped_over_budget=skipped, wall_s=round(time.time() - t_start, 1))
        return info

    # 1. the decode grid, prefill cases and KV writes (always)
    for b, kv in dec_grid:
        impls: dict[str, dict[str, Any]] = {"kernel": {}, "xla_ref": {}}
        if cpu or ("decode", b, kv) in TARGETS_US or (b, kv) == (64, 2048):  # the verdict's figure
            impls = {"kernel": {}, LAYER: {}, "xla_ref": {}}
        if not cpu and (b, kv) in stock_at:
            impls["stock_bf16"] = {}
        emit(functools.partial(bench_decode, rng, b, kv, page, fp8, impls, iters, cpu, kernel_kw, ks, vs),
             f"decode {b}x{kv}")
    pre_impls: dict[str, dict[str, Any]] = {"kernel": {}, LAYER: {}, "xla_ref": {}}
    if not cpu:
        pre_impls["kernel_p_smem"] = {"p_in_registers": False}  # fallback if P-in-registers fails
    for label, ql, cached, prefix in pre_cases:
        emit(functools.partial(bench_prefill, rng, label, ql, cached, prefix, page, fp8, pre_impls, iters, cpu,
                               kernel_kw, ks, vs), f"prefill {label}")
    for t in ([3] if cpu else [1, 64, 1024]):
        emit(functools.partial(bench_write, rng, t, page, fp8, iters, cpu, kernel_kw, ks, vs), f"write {t}")

    # 2. tuning sweeps (skipped when over --budget-s)
    split_sweep = [(1, 740)] if args.quick else ([(1, 740), (4, 740), (8, 512), (32, 128), (1, 4096)] if full else [])
    if args.targets:
        split_sweep = [(8, 512), (32, 128)]
    for b, kv in split_sweep:
        variants: dict[str, dict[str, Any]] = {f"splits={s}": {"num_splits": s} for s in (1, 2, 4, 8)}
        variants.update({"splits=1,depth=4": {"num_splits": 1, "depth": 4},
                         "splits=1,depth=8": {"num_splits": 1, "depth": 8}})
        emit(functools.partial(bench_decode, rng, b, kv, page, fp8, variants, iters, cpu, kernel_kw, ks, vs),
             f"decode splits {b}x{kv}", optional=True)
    if full or args.targets:
        pre_variants = {"1wg": {"num_consumers": 1}, "2wg,regs": {"registers": (208, 88)},
                        "3wg,regs": {"num_consumers": 3, "registers": (144, 80)},
                        "4wg,regs": {"num_consumers": 4, "registers": (104, 80)},
                        "2wg,3stage,3op": {"n_stage": 3, "n_op": 3}}
        for label, ql, cached, prefix in pre_cases[:2]:
            emit(functools.partial(bench_prefill, rng, label, ql, cached, prefix, page, fp8, pre_variants, iters,
                                   cpu, kernel_kw, ks, vs), f"prefill variants {label}", optional=True)
        for b, kv in [(1, 740), (8, 512), (64, 2048)]:
            for p in (16, 32, 128):
                emit(functools.partial(bench_decode, rng, b, kv, p, fp8, {"kernel": {}}, iters, cpu, kernel_kw,
                                       ks, vs), f"decode page {p} {b}x{kv}", optional=True)
        for p in (16, 32, 128):
            emit(functools.partial(bench_prefill, rng, "image 740", [740], [0], [730], p, fp8, {"kernel": {}},
                                   iters, cpu, kernel_kw, ks, vs), f"prefill page {p}", optional=True)
        emit(functools.partial(bench_decode, rng, 64, 2048, page, jnp.bfloat16, {"kernel": {}, "xla_ref": {}},
                               iters, cpu, kernel_kw, ks, vs), "decode bf16 64x2048", optional=True)
        emit(functools.partial(bench_prefill, rng, "image 740", [740], [0], [730], page, jnp.bfloat16, pre_impls,
                               iters, cpu, kernel_kw, ks, vs), "prefill bf16 740", optional=True)

    print_summary(cases, ceil)
    info["ceilings"] = ceil
    info["skipped_over_budget"] = skipped
    info["wall_s"] = round(time.time() - t_start, 1)
    print(f"done in {info['wall_s']}s" + (f"; skipped over budget: {skipped}" if skipped else ""))
    return {"info": info, "cases": cases}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write results as JSON here")
    p.add_argument("--quick", action="store_true", help="a few cases (smoke run on the GPU)")
    p.add_argument("--splits-sweep", action="store_true",
                   help="only: decode call times at batches 1-4 by KV split count (merge included)")
    p.add_argument("--page-sweep", action="store_true", help="only: the kernels at page sizes 16, 32, 64, 128")
    p.add_argument("--targets", action="store_true",
                   help="the issue's target cases, every prefill case and the tuning sweeps (not the full decode grid)")
    p.add_argument("--tune", action="store_true",
                   help="only: the decode kernel at the target cases with 1 and 2 splits (kernel time alone)")
    p.add_argument("--tune-prefill", action="store_true",
                   help="with --tune: the prefill kernel's scheduling variants (ping-pong, in-place PV, 128-row "
                        "warpgroups) too")
    p.add_argument("--tune-prefill-only", action="store_true",
                   help="with --tune: the prefill variants alone (defaults, 64-row multi-consumer, 128-key tiles)")
    p.add_argument("--decode-cases", default="",
                   help="decode cases as 'BxKV,...': with --tune, the cases tuned (default: issue 3's targets "
                        "and a few more); else the part of the B x KV grid to run (default: all of it)")
    p.add_argument("--repeat", type=int, default=1, help="--tune: run the decode cases this many times")
    p.add_argument("--variants", default="",
                   help="with --tune: the decode and prefill variants to run besides the defaults, ';'-separated "
                        "(their labels contain commas)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, interpreted kernels, on the CPU")
    p.add_argument("--page", type=int, default=pa.DEFAULT_PAGE_SIZE, help="page size of the main grid")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per program")
    p.add_argument("--seed", type=int, default=int(time.time()))
    p.add_argument("--budget-s", type=float, default=330.0,
                   help="skip the tuning sweeps once this many seconds have passed (the main cases always run)")
    p.add_argument("--ptxas-info", action="store_true",
                   help="print ptxas register/spill info of every Mosaic kernel (MOSAIC_GPU_DUMP_PTXAS)")
    args = p.parse_args()
    if args.ptxas_info:
        os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"  # read by the Mosaic GPU compiler at each compile
    result = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
