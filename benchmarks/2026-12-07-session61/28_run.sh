# Prepared in session 60 (2026-12-07) for any H100 / H200 (~8 device minutes on a fresh machine; move it into the
# session's dated folder first and fix the path in 29_run.sh). MD3's cold start with the engine's default
# buckets (session 60: 277.7 s with the text step, 182.5 s without, before the lowering cache) with
# `pallas.lowering_cache` on (the default since session 60) and off (KESTREL_JAX_LOWERING_CACHE=0), each with
# its own empty compile cache; then W1 on the warm cache of the first (the default-bucket W1 gap, 798 vs 827,
# session 60). Everything tarred into one file (the device tool returns only a few files).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc\|^W1\|^I1'
export PYTHONPATH=$PWD
X=/tmp/x28; mkdir -p $X
save() { tar czf $OUT/28_all.tgz -C /tmp x28; }
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $X/28_env.txt; cat $X/28_env.txt
for C in 1 0; do
  [ $SECONDS -gt 290 ] && { echo "skip cache=$C ($SECONDS s)"; continue; }
  KESTREL_JAX_LOWERING_CACHE=$C timeout $((560 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights \
    --workloads startup --compile-cache /tmp/cs_$C --out $X/28_startup_md3_cache$C.json 2>&1 \
    | grep -v "$FILT" > $X/28_startup_md3_cache$C.log
  echo "md3 startup lowering_cache=$C ($SECONDS s): $(grep -o "engine ready: .\{0,300\}" $X/28_startup_md3_cache$C.log)"
  grep -i "error\|start failed" $X/28_startup_md3_cache$C.log | head -3; save
done
[ $SECONDS -lt 520 ] && timeout $((585 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights \
  --workloads w1 --compile-cache /tmp/cs_1 --out $X/28_w1_md3_default.json > $X/28_w1_md3_default.log 2>&1
echo "md3 W1 default buckets ($SECONDS s): $(grep -o 'w1: .*of copy)' $X/28_w1_md3_default.log)"; save
