"""Session 59: the batch-1 decode step's optimized HLO as the engine compiles it (KV pool donated),
to find the copies CUPTI shows as `memcpy32_post` (11 per MD3 step, 10 per MD2, ~1.08 us each).
Usage: PYTHONPATH=. python3 benchmarks/2026-12-07-h100-session59/16_hlo.py OUTDIR md3 [--tiny] [--steps 1,8]"""
import argparse
import gzip
import re
import sys
from pathlib import Path

sys.path.insert(0, "tools")
import jax  # noqa: E402
import numpy as np  # noqa: E402
from probe_step_kernels import synthetic_model  # noqa: E402

from kestrel_jax.serving import batch as bt  # noqa: E402
from kestrel_jax.serving.runner import Runner, RunnerConfig  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("model")
ap.add_argument("--tiny", action="store_true")
ap.add_argument("--steps", default="1,8")
a = ap.parse_args()
out = Path(a.out)
out.mkdir(parents=True, exist_ok=True)
m = synthetic_model(a.model, tiny=a.tiny)
page, ctx = 64, 800
cfg = RunnerConfig(num_pages=40, page_size=page, max_seq_len=1024)
r = Runner(m, cfg, out_rows=3)
p = r.max_pages_per_seq
vocab = m.cfg.text.vocab_size
dec = bt.text_decode([(0, ctx, 5, -1)], bucket=1, pages=p, page_size=page)
for steps in [int(s) for s in a.steps.split(",")]:
    fn = r._decode_fn(steps).jitted
    args = (r.lm_params, r.cache, *dec, r._feed(None))
    c = jax.jit(getattr(fn, "__wrapped__", fn), donate_argnums=(1,)).lower(*args).compile()
    txt = c.as_text()
    (out / f"{a.model}_decode{steps}.hlo.txt.gz").write_bytes(gzip.compress(txt.encode()))
    lines = txt.splitlines()
    copies = [ln.strip() for ln in lines if re.search(r"= \S+ copy(-start)?\(", ln)]
    print(f"{a.model} steps={steps}: {len(copies)} copy ops, {len(lines)} HLO lines", flush=True)
    for ln in copies:
        print("   ", ln[:400], flush=True)
    del c
_ = np
