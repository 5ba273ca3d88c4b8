# Session 46, call 2 (H200): the MoE output projection in the down GEMM's launch
# (KESTREL_JAX_PROJ_IN_DOWN=1, new, opt-in): outputs against the default, the batch-1 MD3 step's
# kernels, then W1 pairs (own compile caches, alternating): MD3 default / PROJ_IN_DOWN (only if
# the probe shows it faster), MD2 default / KESTREL_JAX_DENSE_LN_ONE_ROW=1 (call 1: MD2 batch-1
# step -28.8 us, -2.0%).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/2_env.txt
timeout 120 python3 tools/check_decode_fusion.py --model md3 --switch KESTREL_JAX_PROJ_IN_DOWN --batches 1 3 8 \
  --out $OUT/x/2_check.json 2>&1 | grep -v "$FILT" > $OUT/x/2_check.log
echo "check ($SECONDS s):"; grep "max_rel\|rror" $OUT/x/2_check.log | cut -c1-200
timeout 150 python3 tools/probe_step_kernels.py --kernels 40 --top 30 --model md3 --kinds decode --batch 1 \
  --sets default KESTREL_JAX_PROJ_IN_DOWN=1 --json $OUT/x/2_probe_md3.json 2>&1 | grep -v "$FILT" > $OUT/x/2_probe_md3.log
echo "probe ($SECONDS s):"; grep "^\[.*\] decode:\|rror\|-> \|us.*x[0-9]* *->" $OUT/x/2_probe_md3.log | cut -c1-150 | head -30
GAIN=$(python3 - $OUT/x/2_probe_md3.log <<'PY'
import re, sys
t = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\[(.*)\] decode: ([0-9.]+) us", open(sys.argv[1]).read(), re.M)}
print("yes" if "KESTREL_JAX_PROJ_IN_DOWN=1" in t and t["KESTREL_JAX_PROJ_IN_DOWN=1"] < 0.995 * t["default"] else "")
PY
)
ARGS="--engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
run_w1() {  # model variant env...
  local m=$1 v=$2; shift 2
  [ $SECONDS -gt 500 ] && { echo "skip $m W1 $v: $SECONDS s"; return; }
  env "$@" timeout $((590 - SECONDS)) python3 tools/benchmark.py --model $m --random-weights \
    --compile-cache /tmp/cc_${m}_$v --workloads w1 $ARGS --out $OUT/x/2_${m}_w1_$v.json 2>&1 \
    | grep -v "$FILT" > $OUT/x/2_${m}_w1_$v.log
  echo "$m W1 $v ($SECONDS s): $(grep "w1:\|rror" $OUT/x/2_${m}_w1_$v.log | cut -c1-110 | tr '\n' ' ')"
}
if [ -n "$GAIN" ]; then
  run_w1 md3 A KESTREL_JAX_PROJ_IN_DOWN=0
  run_w1 md3 B KESTREL_JAX_PROJ_IN_DOWN=1
fi
run_w1 md2 A KESTREL_JAX_DENSE_LN_ONE_ROW=0
run_w1 md2 B KESTREL_JAX_DENSE_LN_ONE_ROW=1
cd $OUT && tar czf 2_all.tgz x && rm -rf x
