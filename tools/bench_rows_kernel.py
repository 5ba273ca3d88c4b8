#!/usr/bin/env python3
"""The decode GEMM's rows kernel (`gemv_mgpu.gemv_rows`) at batch 1 as the decode step runs it (GPU).

    PYTHONPATH=. python3 tools/bench_rows_kernel.py --out $OUT/rows.json

Each case runs `--layers` layers' worth of kernels on distinct cold weights in one jitted program
and reports CUPTI's kernel time per launch, by kernel family, with the weight bytes streamed per
launch as GB/s and as a fraction of two bandwidth figures measured first in the same process: a
1 GiB add-one copy (read + write) and a 1 GiB sum (read only, the closer ceiling for a weight
stream).

Cases:
- `md2`: an MD2 dense layer's pair at one row, as the default step launches it: the rows kernel
  with the LayerNorm and the previous layer's residual inside ([1, 2048] x [2048, 14336] + bias),
  then the joined output + fc2 product's row-0 split partials ([1, 10240] x [10240, 2048], 4
  splits, 8 stages). Variants: `_late` (the rows kernel's bias loaded after its K loop, not before:
  `bias_early=False`) and ring depths (`_st<n>`; the default is `gemv_mgpu.ROWS_STAGES_LN`, the one-row
  step's).
- `md3`: an MD3 MoE layer's QKV + router rows kernel with the LayerNorm and the tau dots
  ([2048, 6144] + [2048, 64], biases), with the same variants (its default ring:
  `gemv_mgpu.ROWS_STAGES_MOE_LN`).
- `md3_res`: the same with the previous MoE layer's residual inside, as the default step runs it
  (`KESTREL_JAX_MOE_RESIDUAL_IN_ROWS`): the output projection's row-0 partials [4, 2048] f32 and
  bias, and the token's 8 expert rows gathered from [64, 2048] by the [8, 8] tables, at the MoE
  kernel's ring depth (`gemv_mgpu.ROWS_STAGES_MOE_LN`) and others (`_st<n>`).
- `md3_plain` / `md3_split<s>`: MD3's QKV + router pair ([2048, 6144] + [2048, 64]) with nothing
  else in the launch: the rows kernel (97 CTAs, one per 64 columns, each streaming all of K) against
  the split decode GEMM's row-0 partials (`gemv_partials`, s K ranges per column block: 97 s CTAs,
  each streaming K / s), to see whether the 35 SMs the rows kernel leaves idle would stream (H100,
  fifty-eighth session: no; 97, 194 and 388 CTAs 10.4, 10.4 and 11.5 us. The rows kernel in
  clusters of 2 or 4 CTAs splitting K, built then for this, was slower in every case and removed).
- `plain`: the rows kernel alone (no LayerNorm, no bias) at N = 14,336 (224 CTAs, MD2's joined
  product) and at N = 8,448 and 16,896 (132 and 264 CTAs: whole waves on 132 SMs), to see whether
  224 CTAs on 132 SMs cost a wave's imbalance.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel_jax.pallas import gemv_mgpu as g  # noqa: E402

D, FF, MD3_QKV = 2048, 8192, 6144


def measure(f, args, iters: int) -> tuple[float, dict[str, tuple[float, int]]]:
    """(median us per call, {kernel family: (us per call, launches per call)}) from CUPTI."""
    from jax.experimental.mosaic.gpu import profiler

    _, per_iter = profiler.measure(f, aggregate=False, iterations=max(iters, 2))(*args)
    if not per_iter:
        raise RuntimeError("CUPTI returned no kernel timings")
    fams: dict[str, list[float]] = {}
    counts: dict[str, int] = {}
    for ks in per_iter:
        seen: dict[str, int] = {}
        for n, t in ks:
            key = n.split("_mosaic_gpu")[0][:48]
            fams.setdefault(key, []).append(t)
            seen[key] = seen.get(key, 0) + 1
        counts = seen
    out = {k: (round(sum(v) / len(per_iter) * 1e3, 2), counts.get(k, 0)) for k, v in fams.items()}
    return statistics.median(sum(t for _, t in ks) for ks in per_iter) * 1e3, out


def bandwidths(iters: int) -> dict[str, float]:
    x = jax.random.bits(jax.random.key(1), (2**28,), jnp.uint32)  # 1 GiB
    copy_us, _ = measure(jax.jit(lambda a: a + jnp.uint32(1)), (x,), iters)
    read_us, _ = measure(jax.jit(lambda a: jnp.sum(a, dtype=jnp.uint32)), (x,), iters)
    return {"copy_GBps": round(2 * 2**30 / copy_us / 1e3, 1), "read_GBps": round(2**30 / read_us / 1e3, 1)}


def _bf16(key: int, shape: tuple[int, ...], std: float) -> jax.Array:
    return (jax.random.normal(jax.random.key(key), shape, jnp.float32) * std).astype(jnp.bfloat16)


def md2_case(layers: int, stages: int, early: bool) -> tuple[Any, tuple[Any, ...], dict[str, int]]:
    w_in, b_in = _bf16(10, (layers, D, 3 * D + FF), 0.02), _bf16(11, (layers, 3 * D + FF), 0.1)
    w_out, b_out = _bf16(12, (layers, D + FF, D), 0.01), _bf16(13, (layers, D), 0.1)
    scale, shift = jnp.ones((D,), jnp.bfloat16), _bf16(14, (D,), 0.1)
    x0, gin = _bf16(15, (1, D), 1.0), _bf16(16, (1, D + FF), 1.0)
    rows = jax.jit(functools.partial(g.gemv_rows, stages=stages, ln_eps=1e-5, bias_early=early))
    out = jax.jit(functools.partial(g.gemv_partials, splits=4, stages=8, row0=True))

    def step(x, gin, w_in, b_in, w_out, b_out, scale, shift):
        parts = out(gin, w_out[0])
        for i in range(w_in.shape[0]):
            y, n, x = rows(x, w_in[i], b_in[i], ln=(scale, shift), residual=(parts, b_out[i]))
            parts = out(gin, w_out[i])  # (kernels run in stream order; parts feeds the next rows kernel)
        return x, parts

    return jax.jit(step), (x0, gin, w_in, b_in, w_out, b_out, scale, shift), {
        "kestrel_gemv_rows": D * (3 * D + FF) * 2, "kestrel_gemv": (D + FF) * D * 2}


def _md3_operands(layers: int) -> tuple[Any, ...]:
    """x, then per layer the QKV and router weights and biases, the tau weights, the LayerNorm's."""
    w1, b1 = _bf16(20, (layers, D, MD3_QKV), 0.02), _bf16(21, (layers, MD3_QKV), 0.1)
    w2, b2 = _bf16(22, (layers, D, 64), 0.02), _bf16(23, (layers, 64), 0.1)
    wq, wv = _bf16(24, (32, MD3_QKV), 0.05), _bf16(25, (32, MD3_QKV), 0.05)
    scale, shift, x0 = jnp.ones((D,), jnp.bfloat16), _bf16(26, (D,), 0.1), _bf16(27, (1, D), 1.0)
    return x0, w1, b1, w2, b2, wq, wv, scale, shift


def md3_case(layers: int, stages: int, early: bool) -> tuple[Any, tuple[Any, ...], dict[str, int]]:
    rows = jax.jit(functools.partial(g.gemv_rows, stages=stages, ln_eps=1e-5, bias_early=early))

    def step(x, w1, b1, w2, b2, wq, wv, scale, shift):
        return [rows(x, w1[i], b1[i], w2[i], b2[i], tau_w=(wq, wv), ln=(scale, shift))
                for i in range(w1.shape[0])]  # every output returned: no launch is dead code

    return jax.jit(step), _md3_operands(layers), {"kestrel_gemv_rows": D * (MD3_QKV + 64) * 2}


def md3_res_case(layers: int, stages: int) -> tuple[Any, tuple[Any, ...], dict[str, int]]:
    parts = jax.random.normal(jax.random.key(28), (4, D), jnp.float32) * 0.1
    rbias, y = _bf16(29, (D,), 0.1), _bf16(35, (64, D), 0.1)
    dest = jnp.tile(jnp.arange(0, 64, 8, dtype=jnp.int32)[:, None], (1, 8))  # token 0's 8 rows, one per block
    weights = jnp.full((8, 8), 1 / 8, jnp.float32)
    n_valid = jnp.ones((1,), jnp.int32)
    rows = jax.jit(functools.partial(g.gemv_rows, stages=stages, ln_eps=1e-5))

    def step(x, w1, b1, w2, b2, wq, wv, scale, shift, parts, rbias, y, dest, weights, n_valid):
        outs = []
        for i in range(w1.shape[0]):
            *o, x = rows(x, w1[i], b1[i], w2[i], b2[i], tau_w=(wq, wv), ln=(scale, shift),
                         residual=(parts, rbias, (y, dest, weights, n_valid)))
            outs.append(o)  # every output returned: no launch is dead code; x' feeds the next layer
        return outs, x

    return jax.jit(step), (*_md3_operands(layers), parts, rbias, y, dest, weights, n_valid), {
        "kestrel_gemv_rows": D * (MD3_QKV + 64) * 2}


def md3_pair_case(layers: int, splits: int) -> tuple[Any, tuple[Any, ...], dict[str, int]]:
    """The pair with nothing else: `gemv_rows` (splits 0) or
    `gemv_partials(row0=True)` in `splits`."""
    w1, w2 = _bf16(40, (layers, D, MD3_QKV), 0.02), _bf16(41, (layers, D, 64), 0.02)
    x = _bf16(42, (1, D), 1.0)
    if splits:
        kern = jax.jit(functools.partial(g.gemv_partials, splits=splits, stages=8, row0=True))
    else:
        kern = jax.jit(functools.partial(g.gemv_rows, stages=g.ROWS_STAGES))

    def step(x, w1, w2):
        return [kern(x, w1[i], w2[i]) if splits else kern(x, w1[i], None, w2[i], None) for i in range(w1.shape[0])]

    return jax.jit(step), (x, w1, w2), {"kestrel_gemv" if splits else "kestrel_gemv_rows": D * (MD3_QKV + 64) * 2}


def plain_case(layers: int, n: int, stages: int) -> tuple[Any, tuple[Any, ...], dict[str, int]]:
    ws = _bf16(30, (layers, D, n), 0.02)
    x = _bf16(31, (1, D), 1.0)
    rows = jax.jit(functools.partial(g.gemv_rows, stages=stages))

    def step(x, ws):
        return [rows(x, ws[i], None)[0] for i in range(ws.shape[0])]

    return jax.jit(step), (x, ws), {"kestrel_gemv_rows": D * n * 2}


CASES = {  # (the fifty-sixth session's first run, BENCHMARKS.md, had 8 stages and the late bias as its defaults;
    # the fifty-seventh session's ran `md3` at 6 stages, then the default of every one-row LN kernel; the
    # fifty-eighth session's `md2` ran at 6, then ROWS_STAGES_LN)
    "md2": lambda L: md2_case(L, g.ROWS_STAGES_LN, True),
    "md2_late": lambda L: md2_case(L, g.ROWS_STAGES_LN, False),
    "md2_st4": lambda L: md2_case(L, 4, True),
    "md2_st8": lambda L: md2_case(L, 8, True),
    "md2_st6": lambda L: md2_case(L, 6, True),
    "md3": lambda L: md3_case(L, g.ROWS_STAGES_MOE_LN, True),
    "md3_late": lambda L: md3_case(L, g.ROWS_STAGES_MOE_LN, False),
    "md3_st6": lambda L: md3_case(L, 6, True),
    "md3_res": lambda L: md3_res_case(L, g.ROWS_STAGES_MOE_LN),
    "md3_res_st6": lambda L: md3_res_case(L, 6),
    "md3_res_st12": lambda L: md3_res_case(L, 12),
    "md3_plain": lambda L: md3_pair_case(L, 0),
    "md3_split2": lambda L: md3_pair_case(L, 2),
    "md3_split4": lambda L: md3_pair_case(L, 4),
    "plain_224": lambda L: plain_case(L, 224 * g.BLOCK_N, g.ROWS_STAGES),
    "plain_132": lambda L: plain_case(L, 132 * g.BLOCK_N, g.ROWS_STAGES),
    "plain_264": lambda L: plain_case(L, 264 * g.BLOCK_N, g.ROWS_STAGES),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {','.join(CASES)}")
    ap.add_argument("--layers", type=int, default=16, help="layers (distinct weights) per timed call")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2, help="passes over the cases (alternating order)")
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop starting new cases after this")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if jax.default_backend() != "gpu":
        ap.error("bench_rows_kernel.py needs a GPU")
    names = a.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        ap.error(f"unknown cases {unknown}; choose from {list(CASES)}")
    t0 = time.time()
    info: dict[str, Any] = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "layers": a.layers,
                            **bandwidths(a.iters)}
    print(json.dumps(info), flush=True)
    # every case's program and weights kept for the later rounds (~9 GB at 16 layers, all cases)
    built: dict[str, tuple[Any, tuple[Any, ...], dict[str, int]]] = {}
    results: list[dict[str, Any]] = []
    for r in range(a.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            if time.time() - t0 > a.budget_s:
                print(f"budget reached: skipping {name} (round {r})", flush=True)
                continue
            row: dict[str, Any] = {"case": name, "round": r}
            try:
                if name not in built:
                    built[name] = CASES[name](a.layers)
                f, args, wbytes = built[name]
                jax.block_until_ready(f(*args))
                total, fams = measure(f, args, a.iters)
                row["us_per_call"] = round(total, 1)
                for fam, (us, launches) in fams.items():
                    per = us / max(launches, 1)
                    entry: dict[str, Any] = {"us": round(per, 2), "launches": launches}
                    if fam in wbytes:
                        gbps = wbytes[fam] / per / 1e3
                        entry.update(GBps=round(gbps, 1), of_copy=round(gbps / info["copy_GBps"], 3),
                                     of_read=round(gbps / info["read_GBps"], 3))
                    row[fam] = entry
            except Exception as e:  # noqa: BLE001 - record and go on
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                traceback.print_exc(limit=2)
            results.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"info": info, "results": results, "wall_s": round(time.time() - t0, 1)},
                                          indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
