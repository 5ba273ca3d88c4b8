# Session 49, call 4: KESTREL_JAX_LN_IN_ROWS after its second fix (call 3: correct, forward on vs off
# identical, but the rows kernel 11.4 -> 23.7 us: its 64-column GMEM loads of x, scale and bias
# were 128 dependent 4-byte loads per thread). Now one row only: x, scale and bias in 16-byte
# vectors over the warpgroup, statistics reduced over it, the normalised row bounced through SMEM
# into the tiles. Kernel check, batch-1 forward check, probe, W1 pair if the probe shows >= 0.5%.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/4_env.txt
timeout 90 python3 tools/check_ln_in_rows.py --draws 5 --out $OUT/x/4_kernel_check.json 2>&1 \
  | grep -v "$FILT" > $OUT/x/4_kernel_check.log
echo "kernel check ($SECONDS s): $(grep -c '"products_equal": true' $OUT/x/4_kernel_check.log) ok"; grep -i "false\|rror" $OUT/x/4_kernel_check.log | head -3 | cut -c1-250
timeout 110 python3 tools/check_decode_fusion.py --model md3 --logits --switch KESTREL_JAX_LN_IN_ROWS \
  --batches 1 --out $OUT/x/4_check.json 2>&1 | grep -v "$FILT" > $OUT/x/4_check.log
echo "check ($SECONDS s):"; grep "max_rel\|rror" $OUT/x/4_check.log | cut -c1-260
timeout 120 python3 tools/probe_step_kernels.py --kernels 45 --top 30 --model md3 --kinds decode --batch 1 \
  --sets default KESTREL_JAX_LN_IN_ROWS=1 --json $OUT/x/4_probe_md3.json 2>&1 | grep -v "$FILT" > $OUT/x/4_probe_md3.log
echo "probe ($SECONDS s):"; grep "^\[.*\] decode:\|rror\|gemv_rows\|layer_norm_rows" $OUT/x/4_probe_md3.log | cut -c1-150
BEST=$(python3 - $OUT/x/4_probe_md3.log <<'PY'
import re, sys
t = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\[(.*)\] decode: ([0-9.]+) us", open(sys.argv[1]).read(), re.M)}
best = min(t, key=t.get) if t else "default"
print(best if best != "default" and t[best] < 0.995 * t["default"] else "")
PY
)
echo "best: '$BEST'"
[ -z "$BEST" ] && { cd $OUT && tar czf 4_all.tgz x && rm -rf x; exit 0; }
ARGS="--engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
for v in B A; do
  [ $SECONDS -gt $([ $v = B ] && echo 290 || echo 400) ] && { echo "skip W1 $v: $SECONDS s"; continue; }
  ENV="KESTREL_JAX_UNUSED=0"; [ $v = B ] && ENV=$(echo "$BEST" | tr '+' ' ')
  env $ENV timeout $((540 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights \
    --compile-cache /tmp/cc_md3_$v --workloads w1 $ARGS --out $OUT/x/4_md3_w1_$v.json 2>&1 \
    | grep -v "$FILT" > $OUT/x/4_md3_w1_$v.log
  echo "md3 W1 $v ($SECONDS s): $(grep "w1:\|rror" $OUT/x/4_md3_w1_$v.log | cut -c1-150 | tr '\n' ' ')"
done
cd $OUT && tar czf 4_all.tgz x && rm -rf x
