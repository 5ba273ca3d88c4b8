# Session 44, call 5 (H200): KESTREL_JAX_DENSE_OUT_ONE_ROW now on by default (the joined output
# product at one row, on the decode GEMM kernel in 4 K ranges). MD3 W1 with the new defaults and
# with the switch off (own compile caches), then MD2 W1 with the new defaults if time is left.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/5_env.txt
ARGS="--engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
run() { tag=$1; model=$2; shift 2
  env "$@" timeout $((375 - SECONDS)) python3 tools/benchmark.py --model $model --random-weights \
    --compile-cache /tmp/cc_$tag --workloads w1 $ARGS --out $OUT/x/5_$tag.json 2>&1 | grep -v "$FILT" > $OUT/x/5_$tag.log
  echo "$tag ($SECONDS s): $(grep "w1:\|rror" $OUT/x/5_$tag.log | cut -c1-150 | tr '\n' ' ')"; }
run md3_w1_new md3 KESTREL_JAX_UNUSED=0
run md3_w1_off md3 KESTREL_JAX_DENSE_OUT_ONE_ROW=0
[ $SECONDS -lt 280 ] && run md2_w1_new md2 KESTREL_JAX_UNUSED=0
cd $OUT && tar czf 5_all.tgz x && rm -rf x
