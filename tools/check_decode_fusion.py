#!/usr/bin/env python3
"""GPU check of a decode-path switch: one decode forward of a full-size random model (all layers,
a filled KV context) with the switch on and off, compared. Prints the largest difference of the
final hidden states relative to their largest magnitude, and the RMS of the difference relative to
the RMS of the states, per batch size. A random model's depth can amplify last-bit differences
(MD2's 24 layers do); `--layers 1` measures one layer's difference alone.

  PYTHONPATH=. python3 tools/check_decode_fusion.py --switch KESTREL_JAX_LN_KERNEL KESTREL_JAX_GEMV_ROWS
  PYTHONPATH=. python3 tools/check_decode_fusion.py --switch KESTREL_JAX_GEMV_QKV_ROWS=64,1 --batches 64
  PYTHONPATH=. python3 tools/check_decode_fusion.py --model md2 --fused-dense-decode \
      --switch KESTREL_JAX_GEMV_DENSE_OUT=4,0 --batches 64 8 2 --layers 1

A switch is on = 1 against off = 0 unless given as NAME=ON,OFF.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel_jax.models.text import AttentionBatch, KVCache  # noqa: E402
from kestrel_jax.pallas import ops  # noqa: E402
from kestrel_jax.pallas.paged_attention import init_kv_pool  # noqa: E402
from tools.probe_step_kernels import synthetic_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--switch", nargs="+", default=["KESTREL_JAX_TAU_DOTS"],
                    help="one or more switches (NAME, or NAME=ON,OFF for other values than 1 and 0), each "
                         "compared on against off (the others at their defaults)")
    ap.add_argument("--model", default="md3", choices=["md2", "md3"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--context", type=int, default=740)
    ap.add_argument("--fused-dense-decode", action="store_true",
                    help="the dense layers' joined decode weights (`TextModel.fuse_dense_decode`, as the "
                         "runner's default), so that switches of the joined products take effect")
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny model (a CPU smoke run)")
    ap.add_argument("--layers", type=int, default=None,
                    help="only the decoder's first N layers (default all): a difference before depth amplifies it")
    ap.add_argument("--logits", action="store_true",
                    help="also the LM head's logits of each row (`TextModel.model_logits`, one row at a time, as "
                         "a decode step's heads form them at batch 1): their largest difference and argmax")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.layers is not None and a.layers < 1:
        ap.error(f"--layers must be at least 1, got {a.layers}")
    md3 = a.model == "md3"
    model = synthetic_model(a.model, tiny=a.tiny, layers=a.layers).text
    if a.fused_dense_decode and not model.fuse_dense_decode():
        raise SystemExit("--fused-dense-decode: the model joined no dense layer's weights")
    t = model.cfg
    page, maxp = 64, -(-(a.context + 1) // 64)
    pages = maxp * max(a.batches)
    kv_dtype = jnp.float8_e4m3fn if md3 else jnp.bfloat16
    rng = np.random.default_rng(0)
    pool = init_kv_pool(t.n_layers, pages, page, t.n_kv_heads, t.head_dim, kv_dtype)
    fill = [jnp.asarray(rng.standard_normal(pool[0][0].shape) * 8, jnp.float32).astype(kv_dtype) for _ in range(2)]
    scales = jnp.full((t.n_layers,), 0.05, jnp.float32)
    cache = KVCache(tuple(fill[0] for _ in pool), tuple(fill[1] for _ in pool), scales, scales)
    graphdef, state = nnx.split(model)

    def fwd(state, x, cache, positions, slots, kv_lens, table):
        text = nnx.merge(graphdef, state)
        h, _, _ = text(x, AttentionBatch(positions, slots, kv_lens, table), cache)
        if not a.logits:
            return h
        return h, jnp.concatenate([text.model_logits(h[i:i + 1]) for i in range(h.shape[0])])

    res = {"device": jax.devices()[0].device_kind, "model": a.model, "switches": {}}
    for spec in a.switch:
        switch, (on_val, off_val) = switch_values(spec)
        rel_diff: dict[int, dict] = {}
        res["switches"][spec] = rel_diff
        before = os.environ.get(switch)
        for b in a.batches:
            x = jnp.asarray(rng.standard_normal((b, t.dim)), model.wte[...].dtype)
            positions = jnp.full((b,), a.context, jnp.int32)
            table = jnp.arange(b * maxp, dtype=jnp.int32).reshape(b, maxp)
            slots = table[:, a.context // page] * page + a.context % page
            outs, kernels, logits = {}, {}, {}
            for val in (on_val, off_val):
                os.environ[switch] = val
                # The switch is read at trace time, also inside the kernels' jitted entry points, whose
                # traces jax.jit caches per function (a new jit of the same function reuses them):
                # every cache goes, not only ops._jitted's wrappers.
                ops._jitted.cache_clear()
                jax.clear_caches()
                f = jax.jit(lambda *args: fwd(*args))
                args = (state, x, cache, positions, slots, positions + 1, table)
                # Mosaic GPU kernel launches in the compiled forward (after inlining, one custom call per
                # launch; the lowered module holds each jitted kernel function once): whether the switch
                # took effect. (Session 46's call 3 counted the lowered module's: 6 and 6, uninformative.)
                compiled = f.lower(*args).compile()
                kernels[val] = (compiled.as_text() or "").count('custom_call_target="mosaic_gpu')
                res_val = compiled(*args)
                if a.logits:
                    res_val, logit_vals = res_val
                    logits[val] = np.asarray(logit_vals.astype(jnp.float32))
                outs[val] = np.asarray(res_val.astype(jnp.float32))
            on, off = outs[on_val], outs[off_val]
            rel = float(np.abs(on - off).max() / max(np.abs(off).max(), 1e-30))
            rms = float(np.sqrt(np.mean((on - off) ** 2) / max(np.mean(off ** 2), 1e-30)))
            rel_diff[b] = {"max_rel": rel, "rms_rel": rms, "finite": bool(np.isfinite(on).all()),
                           "max_abs_off": float(np.abs(off).max()),
                           "mosaic_calls_on_off": [kernels[on_val], kernels[off_val]]}
            if a.logits:
                lon, loff = logits[on_val], logits[off_val]
                rel_diff[b]["logits_max_rel"] = float(np.abs(lon - loff).max() / max(np.abs(loff).max(), 1e-30))
                rel_diff[b]["logits_argmax_equal"] = int((lon.argmax(1) == loff.argmax(1)).sum())
            print(json.dumps({"switch": spec, "batch": b, **rel_diff[b]}), flush=True)
        if before is None:
            os.environ.pop(switch, None)
        else:
            os.environ[switch] = before
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


def switch_values(spec: str) -> tuple[str, tuple[str, str]]:
    """"NAME" -> (NAME, ("1", "0")); "NAME=ON,OFF" -> (NAME, (ON, OFF))."""
    name, eq, values = spec.partition("=")
    vals = tuple(v.strip() for v in values.split(",")) if eq else ("1", "0")
    if not name.startswith("KESTREL_JAX_") or len(vals) != 2 or not all(vals) or vals[0] == vals[1]:
        raise SystemExit(f"--switch wants KESTREL_JAX_NAME or KESTREL_JAX_NAME=ON,OFF, got {spec!r}")
    return name, (vals[0], vals[1])


if __name__ == "__main__":
    raise SystemExit(main())
