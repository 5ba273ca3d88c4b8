#!/usr/bin/env python3
"""GPU check of the mixed step at full size: a prefill step that carries one decode iteration
must compute what a decode step followed by a prefill step computes (tests/serving/
test_runner_mixed.py checks it on the CPU, where attention is the jnp reference; here the decode
and prefill kernels run). A random-weight model (MD3: FP8 experts and FP8 KV), two sequences
prefilled, then (a) a decode iteration of both and a prefill of a third prompt as two steps,
or (b) the same as one mixed step, each on a fresh runner. Prints per row the sampled tokens,
the largest logprob difference, and for the KV pages the step wrote the share of differing
values and the largest difference relative to the largest magnitude.

  PYTHONPATH=. python3 tools/check_mixed_step.py --model md3 --out mixed.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel_jax.serving import batch as bt  # noqa: E402
from kestrel_jax.serving.runner import Runner, RunnerConfig  # noqa: E402
from tools.probe_step_kernels import synthetic_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="md3", choices=["md2", "md3"])
    ap.add_argument("--lengths", type=int, nargs=3, default=[801, 130, 745],
                    help="prompt tokens of the two decoding sequences and of the new prompt")
    ap.add_argument("--bucket", type=int, default=8, help="decode rows of the decode and mixed steps")
    ap.add_argument("--tokens", type=int, default=1024, help="prefill token bucket")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny model (a CPU smoke run)")
    ap.add_argument("--compile-cache", default=None, help="persistent compile cache (the second runner reuses it)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    model = synthetic_model(a.model, tiny=a.tiny, seed=11)
    page = a.page
    rng = np.random.default_rng(0)
    vocab = model.cfg.text.vocab_size
    la, lb, lc = a.lengths
    prompts = [rng.integers(1, vocab, n).tolist() for n in (la, lb, lc)]
    per = -(-a.tokens // page)  # pages per sequence
    first = [0, per, 2 * per]  # first page of each sequence
    cfg = RunnerConfig(num_pages=3 * per, page_size=page, max_seq_len=per * page, vision_buckets=(2,),
                       compilation_cache_dir=a.compile_cache)
    images = None
    res: dict = {"device": jax.devices()[0].device_kind, "model": a.model, "lengths": a.lengths}
    outs = {}
    for mode in ("separate", "mixed"):
        t0 = time.perf_counter()
        runner = Runner(model, cfg, out_rows=a.bucket + 8)
        p = runner.max_pages_per_seq
        if images is None:
            images = jnp.zeros((1, model.cfg.text.prefix_attn - 1, model.cfg.text.dim), model.dtype)
        pre = bt.text_prefill([(first[0], prompts[0]), (first[1], prompts[1])], tokens=a.tokens, max_seqs=2,
                              pages=p, page_size=page)
        out0 = np.asarray(runner.prefill(*pre, images))
        tok = [int(out0[0, 0]), int(out0[1, 0])]
        specs = (bt.RowSpec(), bt.RowSpec(temperature=0.8, top_p=0.9, seed=7, step=1))
        dec = bt.text_decode([(first[0], la, tok[0], -1), (first[1], lb, tok[1], -1)], bucket=a.bucket, pages=p,
                             page_size=page, specs=specs)
        new = bt.text_prefill([(first[2], prompts[2])], tokens=a.tokens, max_seqs=2, pages=p, page_size=page,
                              specs=(bt.RowSpec(temperature=0.5, seed=3),))
        if mode == "separate":
            d_out, _ = runner.decode(*dec, None)
            p_out = runner.prefill(*new, images)
            got = np.concatenate([np.asarray(d_out)[0, :2], np.asarray(p_out)[:1]])
        else:
            m_out = np.asarray(runner.mixed(*dec, None, *new, images))
            got = np.concatenate([m_out[:2], m_out[a.bucket: a.bucket + 1]])
        kv = np.stack([np.asarray(k.astype(jnp.float32)) for k in (*runner.cache.k, *runner.cache.v)])
        outs[mode] = (got, kv)
        print(f"{mode}: {time.perf_counter() - t0:.1f} s (incl. compiles)", flush=True)
        del runner
    (g1, kv1), (g2, kv2) = outs["separate"], outs["mixed"]
    rows = []
    for i, name in enumerate(("decode greedy", "decode sampled", "prefill sampled")):
        rows.append({"row": name, "token_separate": int(g1[i, 0]), "token_mixed": int(g2[i, 0]),
                     "max_abs_diff_outputs": float(np.abs(g1[i, 1:] - g2[i, 1:]).max())})
        print(json.dumps(rows[-1]), flush=True)
    diff = np.abs(kv1 - kv2)
    res["rows"] = rows
    res["kv"] = {"share_differing": float((diff > 0).mean()), "max_rel": float(diff.max() / np.abs(kv1).max()),
                 "nonzero_share": float((kv1 != 0).mean()), "finite": bool(np.isfinite(kv2).all())}
    # Digests of everything both modes produced: runs under other settings (XLA flags) compare them.
    res["digest"] = {m: hashlib.sha256(g.tobytes() + kv.tobytes()).hexdigest()[:16] for m, (g, kv) in outs.items()}
    res["tokens_equal"] = all(r["token_separate"] == r["token_mixed"] for r in rows)
    print(json.dumps({"kv": res["kv"], "tokens_equal": res["tokens_equal"]}), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0 if res["tokens_equal"] and res["kv"]["finite"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
