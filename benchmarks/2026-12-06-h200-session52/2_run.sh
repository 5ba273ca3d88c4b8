# Session 52, call 2: KESTREL_JAX_LN_IN_ROWS=1 now forms each K step's x tile from the normalised
# row inside the loop (before the wait for its weight tile) instead of all 32 tiles before the first
# MMA (=ahead, session 49's build: rows kernel 11.4 -> 13.9 us on an H100). Kernel check, batch-1
# forward check, probe default / 1 / ahead, W1 pair if the best set is >= 0.5% under the default.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/2_env.txt
timeout 90 python3 tools/check_ln_in_rows.py --draws 5 --out $OUT/x/2_kernel_check.json 2>&1 \
  | grep -v "$FILT" > $OUT/x/2_kernel_check.log
echo "kernel check ($SECONDS s): $(grep -c '"products_equal": true' $OUT/x/2_kernel_check.log) ok"; grep -i "false\|rror" $OUT/x/2_kernel_check.log | head -3 | cut -c1-250
timeout 110 python3 tools/check_decode_fusion.py --model md3 --logits --switch KESTREL_JAX_LN_IN_ROWS \
  --batches 1 --out $OUT/x/2_check.json 2>&1 | grep -v "$FILT" > $OUT/x/2_check.log
echo "check ($SECONDS s):"; grep "max_rel\|rror" $OUT/x/2_check.log | cut -c1-260
timeout 150 python3 tools/probe_step_kernels.py --kernels 45 --top 30 --model md3 --kinds decode --batch 1 \
  --sets default KESTREL_JAX_LN_IN_ROWS=1 KESTREL_JAX_LN_IN_ROWS=ahead --json $OUT/x/2_probe_md3.json 2>&1 \
  | grep -v "$FILT" > $OUT/x/2_probe_md3.log
echo "probe ($SECONDS s):"; grep "^\[.*\] decode:\|rror\|gemv_rows\|layer_norm_rows" $OUT/x/2_probe_md3.log | cut -c1-150
BEST=$(python3 - $OUT/x/2_probe_md3.log <<'PY'
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
  [ $SECONDS -gt $([ $v = B ] && echo 290 || echo 400) ] && { echo "skip W1 $v: $SECONDS s"; continue; }
  ENV="KESTREL_JAX_UNUSED=0"; [ $v = B ] && ENV=$(echo "$BEST" | tr '+' ' ')
  env $ENV timeout $((560 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights \
    --compile-cache /tmp/cc_md3_$v --workloads w1 $ARGS --out $OUT/x/2_md3_w1_$v.json 2>&1 \
    | grep -v "$FILT" > $OUT/x/2_md3_w1_$v.log
  echo "md3 W1 $v ($SECONDS s): $(grep "w1:\|rror" $OUT/x/2_md3_w1_$v.log | cut -c1-150 | tr '\n' ' ')"
done
cd $OUT && tar czf 2_all.tgz x && rm -rf x
