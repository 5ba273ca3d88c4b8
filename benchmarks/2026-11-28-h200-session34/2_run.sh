# Session 34, call 2 (H200): call 1 showed the prefill GEMM is already a cuBLASLt matmul and XLA
# did not fuse jax.nn.gelu(approximate=True) into its epilogue (bf16 output). Which formulations,
# if any, does XLA's GEMM rewriter fuse (GELU / GELU_BIAS epilogue)? One small MLP shape
# ([1536, 2048] x [2048, 8192], MD2's prefill fc1), HLO epilogue field and time per call.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/2_env.txt
cat > /tmp/gelu_forms.py <<'PY'
import math, re, time, jax, jax.numpy as jnp
f32, bf16 = jnp.float32, jnp.bfloat16
k = jax.random.split(jax.random.key(0), 3)
x = jax.random.normal(k[0], (1536, 2048), bf16)
w = (jax.random.normal(k[1], (2048, 8192), f32) * 0.02).astype(bf16)
b = (jax.random.normal(k[2], (8192,), f32) * 0.1).astype(bf16)
C = math.sqrt(2 / math.pi)
def g_explicit(y):
    return 0.5 * y * (1.0 + jnp.tanh(C * (y + 0.044715 * (y * y * y))))
def g_cdf(y):
    return y * (0.5 * (1.0 + jnp.tanh(C * (y + 0.044715 * (y * y * y)))))
forms = {
    "bf16_jaxgelu": lambda x, w, b: jax.nn.gelu(x @ w + b, approximate=True),
    "bf16_explicit": lambda x, w, b: g_explicit(x @ w + b),
    "bf16_nobias": lambda x, w, b: jax.nn.gelu(x @ w, approximate=True),
    "f32out_jaxgelu": lambda x, w, b: jax.nn.gelu(jnp.dot(x, w, preferred_element_type=f32) + b.astype(f32), approximate=True).astype(bf16),
    "f32out_explicit": lambda x, w, b: g_explicit(jnp.dot(x, w, preferred_element_type=f32) + b.astype(f32)).astype(bf16),
    "f32out_cdf": lambda x, w, b: g_cdf(jnp.dot(x, w, preferred_element_type=f32) + b.astype(f32)).astype(bf16),
    "f32out_nobias": lambda x, w, b: jax.nn.gelu(jnp.dot(x, w, preferred_element_type=f32), approximate=True).astype(bf16),
    "f32all": lambda x, w, b: jax.nn.gelu(x.astype(f32) @ w.astype(f32) + b.astype(f32), approximate=True).astype(bf16),
}
ref = jax.jit(forms["f32all"])(x, w, b).astype(f32)
for name, fn in forms.items():
    f = jax.jit(fn)
    try:
        txt = f.lower(x, w, b).compile().as_text()
    except Exception as e:
        print(name, "compile failed", repr(e)[:200]); continue
    calls = [l for l in txt.splitlines() if "custom-call(" in l]
    epi = [m for l in calls for m in re.findall(r'"epilogue":"(\w+)"', l)]
    fus = [re.sub(r"\s+", " ", l)[:90] for l in txt.splitlines() if " fusion(" in l and "ROOT" not in l.split("=")[0]]
    y = f(x, w, b).block_until_ready(); t = time.perf_counter()
    for _ in range(50): y = f(x, w, b)
    y.block_until_ready(); us = (time.perf_counter() - t) / 50 * 1e6
    err = float(jnp.max(jnp.abs(y.astype(f32) - ref)))
    print(f"{name:18s} {us:7.1f} us  epilogue={epi} customcalls={len(calls)} fusions={len(fus)} maxerr={err:.3g}")
    for l in fus[:4]: print("     ", l)
PY
timeout 200 python3 /tmp/gelu_forms.py 2>&1 | grep -v "$FILT" | tee $OUT/x/2_gelu_forms.log | tail -40
cd $OUT && tar czf 2_all.tgz x && rm -rf x
