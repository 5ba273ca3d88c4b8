# Session 43, call 4 (H200): call 3's probe had the output + fc2 product through the decode GEMM
# kernel at 12.6 us against XLA's 14.1 + 4.4 us partial-sum residual, but XLA then carried the
# residual stream transposed (the kernel's partials are y^T) into the next LayerNorm, whose row
# statistics rose 1.5 -> 5.1 us: the step gained only 25 us. Now the product passes an optimization
# barrier in row order. Probe: default and the output product at 4 and 8 splits with 8 ring
# stages; then MD2 W2 C=64 alternating the default and the best variant if it beats the default's
# decode step by 0.3% (each run its own process, one compile cache per setting).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/4_env.txt
timeout 150 python3 tools/probe_step_kernels.py --kernels 30 --top 30 --model md2 --kinds decode --batch 64 \
  --sets default KESTREL_JAX_GEMV_DENSE_OUT=4+KESTREL_JAX_GEMV_DENSE_STAGES=8 \
  KESTREL_JAX_GEMV_DENSE_OUT=8+KESTREL_JAX_GEMV_DENSE_STAGES=8 \
  --json $OUT/x/4_probe.json 2>&1 | grep -v "$FILT" > $OUT/x/4_probe.log
echo "probe rc $? ($SECONDS s)"
grep "^\[.*\] decode:\|^decode: \|^decode wall\|kestrel_gemv\|gemm_fusion_dot_5 \|loop_add_fusion\|input_reduce_fusion \|rror" $OUT/x/4_probe.log | cut -c1-170 | head -40
BEST=$(python3 - $OUT/x/4_probe.log <<'PY'
import re, sys
t = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\[(.*)\] decode: ([0-9.]+) us", open(sys.argv[1]).read(), re.M)}
best = min(t, key=t.get) if t else "default"
print(best if best != "default" and t[best] < 0.997 * t["default"] else "")
PY
)
echo "best: '$BEST'"
[ -z "$BEST" ] && { cd $OUT && tar czf 4_all.tgz x && rm -rf x; exit 0; }
W2ARGS="--concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
i=0
for v in A B A B A B; do
  i=$((i + 1))
  [ $SECONDS -gt 470 ] && { echo "skip run $i ($v): $SECONDS s"; continue; }
  ENV=""; [ $v = B ] && ENV=$(echo "$BEST" | tr '+' ' ')
  env $ENV timeout $((580 - SECONDS)) python3 tools/benchmark.py --model md2 --random-weights \
    --compile-cache /tmp/cc_md2_$v --workloads w2 $W2ARGS --out $OUT/x/4_md2_${i}_$v.json 2>&1 \
    | grep -v "$FILT" > $OUT/x/4_md2_${i}_$v.log
  echo "md2 run $i $v ($SECONDS s): $(grep "w2 C=64\|rror" $OUT/x/4_md2_${i}_$v.log | cut -c1-120 | tr '\n' ' ')"
done
cd $OUT && gzip x/4_md2*.json; tar czf 4_all.tgz x && rm -rf x
