# Session 46, call 3 (H200): the side product checked at production shapes on the GPU
# (tools/check_side_product.py), one MoE layer's forward with KESTREL_JAX_PROJ_IN_DOWN on / off
# (with the Mosaic kernel counts that show the switch took effect), then a second W1 pair of each
# switch, in the order opposite to call 2's (B first).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/3_env.txt
timeout 90 python3 tools/check_side_product.py --tokens 1 3 8 --out $OUT/x/3_side.json 2>&1 | grep -v "$FILT" > $OUT/x/3_side.log
echo "side ($SECONDS s): rc ${PIPESTATUS[0]}"; grep "tokens\|rror" $OUT/x/3_side.log | cut -c1-200
timeout 100 python3 tools/check_decode_fusion.py --model md3 --switch KESTREL_JAX_PROJ_IN_DOWN --batches 1 3 \
  --layers 5 --out $OUT/x/3_check.json 2>&1 | grep -v "$FILT" > $OUT/x/3_check.log
echo "check ($SECONDS s):"; grep "max_rel\|rror" $OUT/x/3_check.log | cut -c1-220
ARGS="--engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
run_w1() {  # model variant env...
  local m=$1 v=$2; shift 2
  [ $SECONDS -gt 480 ] && { echo "skip $m W1 $v: $SECONDS s"; return; }
  env "$@" timeout $((590 - SECONDS)) python3 tools/benchmark.py --model $m --random-weights \
    --compile-cache /tmp/cc_${m}_$v --workloads w1 $ARGS --out $OUT/x/3_${m}_w1_$v.json 2>&1 \
    | grep -v "$FILT" > $OUT/x/3_${m}_w1_$v.log
  echo "$m W1 $v ($SECONDS s): $(grep "w1:\|rror" $OUT/x/3_${m}_w1_$v.log | cut -c1-110 | tr '\n' ' ')"
}
run_w1 md3 B KESTREL_JAX_PROJ_IN_DOWN=1
run_w1 md3 A KESTREL_JAX_PROJ_IN_DOWN=0
run_w1 md2 B KESTREL_JAX_DENSE_LN_ONE_ROW=1
run_w1 md2 A KESTREL_JAX_DENSE_LN_ONE_ROW=0
cd $OUT && tar czf 3_all.tgz x && rm -rf x
