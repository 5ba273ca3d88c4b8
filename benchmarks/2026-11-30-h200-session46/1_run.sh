# Prepared in session 45 (2026-11-30), which had no device time; not yet run. For the next session's
# first call (H200): batch-1 decode probes of the opt-in switches built in sessions 44-45, then a
# W1 pair (own compile caches) for the best MD3 set if it beats the default by > 0.5%.
#   KESTREL_JAX_DENSE_LN_ONE_ROW=1     dense layers' one-row LayerNorm on the rows kernel
#   KESTREL_JAX_GEMV_PROJ_SPLITS/_STAGES  MoE layers' decode output projection (default 8 / 4)
#   KESTREL_JAX_GEMV_ROWS_STAGES       QKV + router rows kernel ring depth (default 8)
# Move this file into the session's dated folder before running it.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/1_env.txt
S3="default KESTREL_JAX_DENSE_LN_ONE_ROW=1 KESTREL_JAX_GEMV_PROJ_SPLITS=4 KESTREL_JAX_GEMV_PROJ_SPLITS=4+KESTREL_JAX_GEMV_PROJ_STAGES=8 KESTREL_JAX_GEMV_ROWS_STAGES=4 KESTREL_JAX_GEMV_ROWS_STAGES=6 KESTREL_JAX_GEMV_ROWS_STAGES=12"
S2="default KESTREL_JAX_DENSE_LN_ONE_ROW=1"
for m in md3 md2; do
  SETS=$S3; [ $m = md2 ] && SETS=$S2
  timeout 220 python3 tools/probe_step_kernels.py --kernels 40 --top 30 --model $m --kinds decode --batch 1 \
    --sets $SETS --json $OUT/x/1_probe_$m.json 2>&1 | grep -v "$FILT" > $OUT/x/1_probe_$m.log
  echo "probe $m ($SECONDS s):"; grep "^\[.*\] decode:\|rror" $OUT/x/1_probe_$m.log | cut -c1-150
done
BEST=$(python3 - $OUT/x/1_probe_md3.log <<'PY'
import re, sys
t = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\[(.*)\] decode: ([0-9.]+) us", open(sys.argv[1]).read(), re.M)}
best = min(t, key=t.get) if t else "default"
print(best if best != "default" and t[best] < 0.995 * t["default"] else "")
PY
)
echo "best md3: '$BEST'"
[ -z "$BEST" ] && { cd $OUT && tar czf 1_all.tgz x && rm -rf x; exit 0; }
ARGS="--engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
for v in A B; do
  [ $SECONDS -gt 400 ] && { echo "skip W1 $v: $SECONDS s"; continue; }
  ENV=""; [ $v = B ] && ENV=$(echo "$BEST" | tr '+' ' ')
  env $ENV timeout $((585 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights \
    --compile-cache /tmp/cc_md3_$v --workloads w1 $ARGS --out $OUT/x/1_md3_w1_$v.json 2>&1 \
    | grep -v "$FILT" > $OUT/x/1_md3_w1_$v.log
  echo "md3 W1 $v ($SECONDS s): $(grep "w1:\|rror" $OUT/x/1_md3_w1_$v.log | cut -c1-150 | tr '\n' ' ')"
done
cd $OUT && tar czf 1_all.tgz x && rm -rf x
