# Session 34, call 1 (H200): XLA's cuBLASLt path (--xla_gpu_enable_cublaslt=true, off by default)
# can fuse the tanh-GELU after a GEMM into the GEMM's epilogue. MD2's prefill fc1 GELU
# (loop_multiply_fusion, 20.4 us per layer per mixed step) and the vision MLP's GELU are ~3% of
# MD2 W2's device time (session 32 trace). (1) does the rewrite fire here (HLO of a small MLP);
# (2) MD2 prefill/mixed steps kernel by kernel with and without; (3) MD2 W2 C=64 A/B (own caches).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/1_env.txt
LT="--xla_gpu_enable_cublaslt=true"
cat > /tmp/mlp_hlo.py <<'PY'
import re, jax, jax.numpy as jnp
k = jax.random.split(jax.random.key(0), 3)
x = jax.random.normal(k[0], (1536, 2048), jnp.bfloat16)
w = jax.random.normal(k[1], (2048, 8192), jnp.bfloat16) * 0.02
b = jnp.zeros((8192,), jnp.bfloat16)
f = jax.jit(lambda x, w, b: jax.nn.gelu(x @ w + b, approximate=True))
txt = f.lower(x, w, b).compile().as_text()
for line in txt.splitlines():
    if "custom-call" in line or "fusion(" in line and "ROOT" in line:
        print(re.sub(r"\s+", " ", line)[:400])
import time
y = f(x, w, b).block_until_ready(); t = time.perf_counter()
for _ in range(50): y = f(x, w, b)
y.block_until_ready(); print("us per call", (time.perf_counter() - t) / 50 * 1e6)
PY
for v in off on; do
  [ $v = on ] && export XLA_FLAGS="$LT"
  echo "== mlp $v"; timeout 90 python3 /tmp/mlp_hlo.py 2>&1 | grep -v "$FILT" | tail -12
  timeout 200 python3 tools/probe_step_kernels.py --kernels 40 --top 40 --model md2 --kinds mixed,prefill \
    --batch 64 --context 800 --tokens 1536 --prompt 740 --wall-rounds 5 --json $OUT/x/1_probe_$v.json 2>&1 | grep -v "$FILT" > $OUT/x/1_probe_$v.log
  echo "probe $v ($SECONDS s): $(grep "launches (" $OUT/x/1_probe_$v.log | cut -c1-200)"
  unset XLA_FLAGS
done
W2="--concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1"
for v in off on; do
  [ $v = on ] && export XLA_FLAGS="$LT"
  [ $SECONDS -gt 420 ] && { echo "skip w2 $v: $SECONDS s"; continue; }
  timeout $((580 - SECONDS)) python3 tools/benchmark.py --model md2 --random-weights --compile-cache /tmp/cc_md2_$v \
    --workloads w2 $W2 --out $OUT/x/1_w2_md2_$v.json 2>&1 | grep -v "$FILT" > $OUT/x/1_w2_md2_$v.log
  echo "w2 $v ($SECONDS s): $(grep "w2 C=64\|rror" $OUT/x/1_w2_md2_$v.log | cut -c1-160 | head -2 | tr '\n' ' ')"
  unset XLA_FLAGS
done
cd $OUT && tar czf 1_all.tgz x && rm -rf x
