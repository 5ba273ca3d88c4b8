# Prepared in session 46 (2026-11-30), not yet run: MD2 batch-1 probe of the opt-in joined input
# product at one row (KESTREL_JAX_DENSE_IN_ONE_ROW=1) with the QKV epilogue reading its columns in
# place (KESTREL_JAX_DECODE_QKV_WIDE=1): it should drop the 1.5 us QKV bias add per dense layer
# (MD2: 24 of them). Then an MD2 W1 pair if the probe shows it > 0.5% faster.
# Run as session 47's second call (2026-12-03).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/2_env.txt
timeout 150 python3 tools/check_decode_fusion.py --model md2 --fused-dense-decode \
  --switch KESTREL_JAX_DENSE_IN_ONE_ROW --batches 1 --out $OUT/x/2_check.json 2>&1 | grep -v "$FILT" > $OUT/x/2_check.log
echo "check ($SECONDS s):"; grep "max_rel\|rror" $OUT/x/2_check.log | cut -c1-200
SETS="default KESTREL_JAX_DENSE_IN_ONE_ROW=1+KESTREL_JAX_DECODE_QKV_WIDE=1 KESTREL_JAX_DENSE_IN_ONE_ROW=1"
timeout 200 python3 tools/probe_step_kernels.py --kernels 40 --top 30 --model md2 --kinds decode --batch 1 \
  --sets $SETS --json $OUT/x/2_probe_md2.json 2>&1 | grep -v "$FILT" > $OUT/x/2_probe_md2.log
echo "probe ($SECONDS s):"; grep "^\[.*\] decode:\|rror" $OUT/x/2_probe_md2.log | cut -c1-150
BEST=$(python3 - $OUT/x/2_probe_md2.log <<'PY'
import re, sys
t = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\[(.*)\] decode: ([0-9.]+) us", open(sys.argv[1]).read(), re.M)}
best = min(t, key=t.get) if t else "default"
print(best if best != "default" and t[best] < 0.995 * t["default"] else "")
PY
)
echo "best: '$BEST'"
[ -z "$BEST" ] && { cd $OUT && tar czf 2_all.tgz x && rm -rf x; exit 0; }
ARGS="--engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
for v in B A; do
  [ $SECONDS -gt 450 ] && { echo "skip W1 $v: $SECONDS s"; continue; }
  ENV="KESTREL_JAX_UNUSED=0"; [ $v = B ] && ENV=$(echo "$BEST" | tr '+' ' ')
  env $ENV timeout $((585 - SECONDS)) python3 tools/benchmark.py --model md2 --random-weights \
    --compile-cache /tmp/cc_md2_$v --workloads w1 $ARGS --out $OUT/x/2_md2_w1_$v.json 2>&1 \
    | grep -v "$FILT" > $OUT/x/2_md2_w1_$v.log
  echo "md2 W1 $v ($SECONDS s): $(grep "w1:\|rror" $OUT/x/2_md2_w1_$v.log | cut -c1-150 | tr '\n' ' ')"
done
cd $OUT && tar czf 2_all.tgz x && rm -rf x
