#!/usr/bin/env python3
"""GPU check of the decode GEMM's rows kernel with the LayerNorm inside (`gemv_mgpu.gemv_rows(ln=...)`,
KESTREL_JAX_LN_IN_ROWS) at an MoE layer's shapes (QKV [2048, 6144] + router [2048, 64] bf16, MD3's
tau dots over the QKV row): on fresh random residual rows (a mean offset and a spread) the
normalised row it appends must be `ln_rows_ref`'s within one bf16 rounding, and the QKV rows,
router rows and tau dots must equal, bit for bit, the rows kernel's fed those normalised rows
(exit status 1 otherwise). `--dense`: a dense layer's joined QKV + fc1 product instead (one
product, no tau dots). `--residual` (with `--dense`): the rows kernel also adds the previous
layer's output to x first (`gemv_rows`' residual, KESTREL_JAX_DENSE_RESIDUAL_IN_ROWS), from the
row-0 partials of a one-row [1, 10240] x [10240, 2048] product (`gemv_partials(row0=True)`, which
must equal column 0 of the padded partials bit for bit): the new row must be the exactly rounded
x + finished partials, and the normalised row and products those of the rows kernel fed it.
`--small` runs the interpreted kernel at test sizes on the CPU (a smoke run).

  PYTHONPATH=. python3 tools/check_ln_in_rows.py --draws 5 --out ln_in_rows.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel_jax.pallas import gemv_mgpu as g  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draws", type=int, default=5, help="fresh inputs")
    ap.add_argument("--small", action="store_true", help="test sizes, interpreted (CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ahead", action="store_true",
                    help="every x tile formed before the first MMA (`ln_tiles_ahead`), not step by step")
    ap.add_argument("--dense", action="store_true",
                    help="a dense layer's joined QKV + fc1 product ([2048, 14336], one product, no tau dots)")
    ap.add_argument("--residual", action="store_true",
                    help="with --dense: the previous layer's output added in the kernel first")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    K, N1, N2 = (512, 192, 64) if a.small else (2048, 6144, 64)
    if a.dense:
        N1 = 448 if a.small else 14336
    H = g.TAU_ROWS // 2
    rng = np.random.default_rng(a.seed)

    def bf16(shape, std):
        return jnp.asarray(rng.standard_normal(shape) * std, jnp.bfloat16)

    w1, b1 = bf16((K, N1), 1 / math.sqrt(K)), bf16((N1,), 0.1)
    w2, b2 = bf16((K, N2), 1 / math.sqrt(K)), bf16((N2,), 0.1)
    wq, wv = bf16((H, N1), 0.05), bf16((H, N1), 0.05)
    scale = jnp.asarray(rng.uniform(0.5, 1.5, K), jnp.bfloat16)
    bias = bf16((K,), 0.1)
    run = functools.partial(g.gemv_rows, tau_w=None if a.dense else (wq, wv), interpret=a.small)
    with_ln = jax.jit(functools.partial(run, ln=(scale, bias), ln_eps=1e-5, ln_tiles_ahead=a.ahead))
    plain = jax.jit(run)
    pair = (w1, b1) if a.dense else (w1, b1, w2, b2)
    res: dict = {"device": jax.devices()[0].device_kind, "small": a.small, "ahead": a.ahead, "dense": a.dense,
                 "residual": a.residual, "cases": []}
    if a.residual and not a.dense:
        ap.error("--residual needs --dense")
    K_out = 1024 if a.small else 10240  # MD2's joined output + fc2 product: [1, 10240] x [10240, 2048]
    w_out, b_out = (bf16((K_out, K), 1 / math.sqrt(K_out)), bf16((K,), 0.1)) if a.residual else (None, None)
    partials = jax.jit(functools.partial(g.gemv_partials, splits=4, stages=8, interpret=a.small))
    row0 = jax.jit(functools.partial(g.gemv_partials, splits=4, stages=8, row0=True, interpret=a.small))
    for d in range(a.draws):
        x = jnp.asarray(rng.standard_normal((1, K)) * rng.uniform(0.5, 4.0) + rng.uniform(-2, 2), jnp.bfloat16)
        extra: dict = {}
        if a.residual:
            gin = jnp.asarray(rng.standard_normal((1, K_out)) * rng.uniform(0.5, 2.0), jnp.bfloat16)
            parts = row0(gin, w_out)
            x0 = x
            *ys, n, x = with_ln(x0, *pair, residual=(parts, b_out))
            want_x = _exact_residual(x0, np.asarray(parts), np.asarray(b_out))
            padded = np.asarray(partials(gin, w_out))[:, :, 0]
            extra = {"row0_equals_padded": bool(np.array_equal(np.asarray(parts), padded)),
                     "residual_exact": bool(np.array_equal(np.asarray(x.astype(jnp.float32)), want_x)),
                     "residual_elements_differing": int((np.asarray(x.astype(jnp.float32)) != want_x).sum())}
            *ys_ln, n_ln = with_ln(x, *pair)
            extra["ln_and_products_equal_fed_the_row"] = bool(
                np.array_equal(np.asarray(n.astype(jnp.float32)), np.asarray(n_ln.astype(jnp.float32)))
                and all(np.array_equal(np.asarray(y.astype(jnp.float32)), np.asarray(r.astype(jnp.float32)))
                        for y, r in zip(ys, ys_ln, strict=True)))
        else:
            *ys, n = with_ln(x, *pair)
        ref = plain(n[:1], *pair)
        got = np.asarray(n.astype(jnp.float32))
        want = np.asarray(g.ln_rows_ref(x, scale, bias, 1e-5).astype(jnp.float32))
        tol = 2.0**-8 * np.maximum(np.abs(want), 2.0**-6 * np.abs(want).max())
        case = {"draw": d,
                "ln_within_one_rounding": bool((np.abs(got - want) <= tol).all()),
                "ln_elements_differing": int((got != want).sum()),
                "padding_rows_zero": bool(not got[1:].any()),
                "products_equal": all(bool(np.array_equal(np.asarray(y.astype(jnp.float32)),
                                                          np.asarray(r.astype(jnp.float32))))
                                      for y, r in zip(ys, ref, strict=True)),
                "finite": bool(all(np.isfinite(np.asarray(y.astype(jnp.float32))).all() for y in ys)), **extra}
        res["cases"].append(case)
        print(json.dumps(case), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    keys = ("ln_within_one_rounding", "padding_rows_zero", "products_equal", "finite") + (
        ("row0_equals_padded", "residual_exact", "ln_and_products_equal_fed_the_row") if a.residual else ())
    return 1 if any(not all(c[k] for k in keys) for c in res["cases"]) else 0


def _exact_residual(x: jax.Array, parts: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """x + (parts summed in order in f32, rounded to bf16, + bias, rounded), rounded to bf16, in
    numpy (one rounding per operation), as f32."""
    s = parts[0].astype(np.float32)
    for i in range(1, parts.shape[0]):
        s = (s + parts[i]).astype(np.float32)
    y = (s.astype(jnp.bfloat16).astype(np.float32) + bias.astype(np.float32)).astype(jnp.bfloat16)
    return (np.asarray(x).astype(np.float32) + y.astype(np.float32)[None]).astype(jnp.bfloat16).astype(np.float32)


if __name__ == "__main__":
    sys.exit(main())
