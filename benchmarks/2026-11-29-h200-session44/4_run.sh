# Session 44, call 4 (H200): call 3's batch-1 listings show a one-row dense layer running its output
# projection on the decode GEMM kernel (MD2 3.70 us for 8.4 MB) and fc2 on XLA's (12.41 us for
# 33.5 MB) with a residual add over both. New opt-in KESTREL_JAX_DENSE_OUT_ONE_ROW=1 forms the two as
# the one product over the joined weights (XLA's GEMM, or with _GEMV_DENSE_OUT_ONE_ROW=S the decode
# GEMM kernel in S K ranges). Check the outputs (one MD2 layer), probe MD2 and MD3 batch-1 steps,
# then MD2 W1 default against the best variant (own compile caches).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/4_env.txt
timeout 90 python3 tools/check_decode_fusion.py --fused-dense-decode --model md2 --layers 2 --batches 1 \
  --switch KESTREL_JAX_DENSE_OUT_ONE_ROW --out $OUT/x/4_check.json 2>&1 | grep -v "$FILT" > $OUT/x/4_check.log
echo "check ($SECONDS s):"; grep '^{\|rror' $OUT/x/4_check.log | head -5
SETS="default KESTREL_JAX_DENSE_OUT_ONE_ROW=1 KESTREL_JAX_DENSE_OUT_ONE_ROW=1+KESTREL_JAX_GEMV_DENSE_OUT_ONE_ROW=4 KESTREL_JAX_DENSE_OUT_ONE_ROW=1+KESTREL_JAX_GEMV_DENSE_OUT_ONE_ROW=8"
for m in md2 md3; do
  timeout 170 python3 tools/probe_step_kernels.py --kernels 40 --top 30 --model $m --kinds decode --batch 1 \
    --sets $SETS --json $OUT/x/4_probe_$m.json 2>&1 | grep -v "$FILT" > $OUT/x/4_probe_$m.log
  echo "probe $m ($SECONDS s):"; grep "^\[.*\] decode:\|rror" $OUT/x/4_probe_$m.log | cut -c1-150
done
BEST=$(python3 - $OUT/x/4_probe_md2.log <<'PY'
import re, sys
t = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\[(.*)\] decode: ([0-9.]+) us", open(sys.argv[1]).read(), re.M)}
best = min(t, key=t.get) if t else "default"
print(best if best != "default" and t[best] < 0.995 * t["default"] else "")
PY
)
echo "best: '$BEST'"
[ -z "$BEST" ] && { cd $OUT && tar czf 4_all.tgz x && rm -rf x; exit 0; }
ARGS="--engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
for v in A B; do
  [ $SECONDS -gt 440 ] && { echo "skip W1 $v: $SECONDS s"; continue; }
  ENV=""; [ $v = B ] && ENV=$(echo "$BEST" | tr '+' ' ')
  env $ENV timeout $((570 - SECONDS)) python3 tools/benchmark.py --model md2 --random-weights \
    --compile-cache /tmp/cc_md2_$v --workloads w1 $ARGS --out $OUT/x/4_md2_w1_$v.json 2>&1 \
    | grep -v "$FILT" > $OUT/x/4_md2_w1_$v.log
  echo "md2 W1 $v ($SECONDS s): $(grep "w1:\|rror" $OUT/x/4_md2_w1_$v.log | cut -c1-150 | tr '\n' ' ')"
done
cd $OUT && tar czf 4_all.tgz x && rm -rf x
