# Session 24, call 6: KESTREL_JAX_TAU_DOTS_KERNEL (tau's GELU and both dots in one Triton launch at
# prefill sizes). Numbers on the GPU against the jnp expressions at MD3's prefill shapes, then the
# prefill and mixed steps A/B (one probe process, 1536-token bucket, 64 decode rows).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
python3 - > $OUT/x/6_check.log 2>&1 <<'PY'
import jax, jax.numpy as jnp, numpy as np
from kestrel_jax.pallas import tau_dots_triton as td
rng = np.random.default_rng(0)
for t in (128, 1536, 1600, 2048):
    u = jnp.asarray(rng.standard_normal((t, 6144)) * rng.choice([0.3, 1.0, 4.0], (t, 1)), jnp.bfloat16)
    wq = jnp.asarray(rng.standard_normal((32, 6144)) / 78, jnp.bfloat16)
    wv = jnp.asarray(rng.standard_normal((32, 6144)) / 78, jnp.bfloat16)
    pq, pv = td.tau_dots(u, wq, wv)
    rq, rv = jax.jit(td.tau_dots_ref)(u, wq, wv)
    for name, g, w in (("q", pq.sum(0), rq), ("v", pv.sum(0), rv)):
        g, w = np.asarray(g), np.asarray(w)
        err = np.abs(g - w).max() / np.abs(w).max()
        same = np.mean(np.asarray(jnp.asarray(g).astype(jnp.bfloat16) == jnp.asarray(w).astype(jnp.bfloat16)))
        print(f"tau_dots T={t} {name}: max err / max |dot| {err:.2e}, finite {np.isfinite(g).all()}, bf16-identical {same:.4f}")
PY
cat $OUT/x/6_check.log | grep -v "$FILT" | tail -8
timeout 420 python3 tools/probe_step_kernels.py --kernels 40 --top 30 --model md3 --kinds prefill,mixed \
  --tokens 1536 --prompt 740 --batch 64 --sets default KESTREL_JAX_TAU_DOTS_KERNEL=1 \
  --json $OUT/x/6_probe.json 2>&1 | grep -v "$FILT" > $OUT/x/6_probe.log
echo "probe ($SECONDS s):"; grep "^\[" $OUT/x/6_probe.log | head; grep -A14 "^prefill: \|^mixed: " $OUT/x/6_probe.log | grep -v "^\[" | head -40
cd $OUT && tar czf 6_all.tgz x && rm -rf x
