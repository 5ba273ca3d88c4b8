# Session 47, call 4 (H200): what this session built on the CPU after call 3. GPU output checks
# (full-size MD3, batch 1, the forward and with --logits the LM head's row): the joined input
# product in MD3's tau dense layers with the QKV epilogue reading it in place (tau over its QKV
# columns; KESTREL_JAX_DENSE_IN_ONE_ROW=1, opt-in), and the one-row LayerNorm switch, which now also
# covers post_ln; then batch-1 decode step listings (MD3 default vs the joined product, MD2 default:
# the f32 convert of the logits should be gone, the LayerNorm kernel one launch more), MD3 W1 with
# the defaults, and with the joined product if the probe shows it >= 0.5% faster.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/4_env.txt
timeout 100 python3 tools/check_decode_fusion.py --model md3 --fused-dense-decode --logits \
  --switch KESTREL_JAX_DENSE_IN_ONE_ROW KESTREL_JAX_DENSE_LN_ONE_ROW --batches 1 --out $OUT/x/4_check.json 2>&1 \
  | grep -v "$FILT" > $OUT/x/4_check.log
echo "check ($SECONDS s):"; grep "max_rel\|rror" $OUT/x/4_check.log | cut -c1-260
timeout 120 python3 tools/probe_step_kernels.py --kernels 45 --top 30 --model md3 --kinds decode --batch 1 \
  --sets default KESTREL_JAX_DENSE_IN_ONE_ROW=1 --json $OUT/x/4_probe_md3.json 2>&1 | grep -v "$FILT" > $OUT/x/4_probe_md3.log
echo "probe md3 ($SECONDS s):"; grep "^\[.*\] decode:\|rror\|convert_fusion  *f32\[51200\]\|layer_norm_rows  " $OUT/x/4_probe_md3.log | cut -c1-150
timeout 80 python3 tools/probe_step_kernels.py --kernels 45 --top 30 --model md2 --kinds decode --batch 1 \
  --json $OUT/x/4_probe_md2.json 2>&1 | grep -v "$FILT" > $OUT/x/4_probe_md2.log
echo "probe md2 ($SECONDS s):"; grep "^\[.*\] decode:\|decode:.*launches\|rror" $OUT/x/4_probe_md2.log | cut -c1-150
BEST=$(python3 - $OUT/x/4_probe_md3.log <<'PY'
import re, sys
t = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\[(.*)\] decode: ([0-9.]+) us", open(sys.argv[1]).read(), re.M)}
best = min(t, key=t.get) if t else "default"
print(best if best != "default" and t[best] < 0.995 * t["default"] else "")
PY
)
echo "best: '$BEST'"
ARGS="--engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
for v in A B; do
  [ $v = B ] && [ -z "$BEST" ] && continue
  [ $SECONDS -gt 330 ] && { echo "skip W1 $v: $SECONDS s"; continue; }
  ENV="KESTREL_JAX_UNUSED=0"; [ $v = B ] && ENV=$(echo "$BEST" | tr '+' ' ')
  env $ENV timeout $((455 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights \
    --compile-cache /tmp/cc_md3_$v --workloads w1 $ARGS --out $OUT/x/4_md3_w1_$v.json 2>&1 \
    | grep -v "$FILT" > $OUT/x/4_md3_w1_$v.log
  echo "md3 W1 $v ($SECONDS s): $(grep "w1:\|rror" $OUT/x/4_md3_w1_$v.log | cut -c1-150 | tr '\n' ' ')"
done
cd $OUT && tar czf 4_all.tgz x && rm -rf x
