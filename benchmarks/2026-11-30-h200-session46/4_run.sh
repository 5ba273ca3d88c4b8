# Session 46, call 4 (H200): after both switches became defaults (KESTREL_JAX_PROJ_IN_DOWN,
# KESTREL_JAX_DENSE_LN_ONE_ROW): MD3 W1 with the defaults alone, then the MD2 W1 run with
# KESTREL_JAX_DENSE_LN_ONE_ROW=0 that call 3 had no time left for (its second pair's A).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/4_env.txt
ARGS="--engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
run_w1() {  # model variant env...
  local m=$1 v=$2; shift 2
  env "$@" timeout $((315 - SECONDS)) python3 tools/benchmark.py --model $m --random-weights \
    --compile-cache /tmp/cc_${m}_$v --workloads w1 $ARGS --out $OUT/x/4_${m}_w1_$v.json 2>&1 \
    | grep -v "$FILT" > $OUT/x/4_${m}_w1_$v.log
  echo "$m W1 $v ($SECONDS s): $(grep "w1:\|rror" $OUT/x/4_${m}_w1_$v.log | cut -c1-110 | tr '\n' ' ')"
}
run_w1 md3 default KESTREL_JAX_UNUSED=0
run_w1 md2 A KESTREL_JAX_DENSE_LN_ONE_ROW=0
cd $OUT && tar czf 4_all.tgz x && rm -rf x
