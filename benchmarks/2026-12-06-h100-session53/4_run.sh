# Session 53 (2026-12-06), call 2 (H100). Call 1 (3_run.sh) gave, on an H100: MD3 probe -1.08% with
# KESTREL_JAX_LN_IN_ROWS=1 + KESTREL_JAX_DENSE_LN_IN_ROWS=1, W1 810.6 (on) vs 800.9 (off) tok/s, its
# second pair cut by the call's limit; MD2 probe -0.74% with KESTREL_JAX_DENSE_LN_IN_ROWS=1, no W1.
# This call: MD3 W1 A then B (the reverse of call 1's order), then MD2 W1 B then A. Each run is its
# own process and compile cache; outputs tarred into $OUT after each run.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
X=/tmp/x; rm -rf $X; mkdir -p $X
save() { tar czf $OUT/4_all.tgz -C /tmp x; }
ARGS="--engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
for run in md3_A2 md3_B2 md2_B1 md2_A1; do
  M=${run%_*}; v=${run#*_}; v=${v:0:1}
  ENV="KESTREL_JAX_UNUSED=0"
  [ $v = B ] && { [ $M = md3 ] && ENV="KESTREL_JAX_LN_IN_ROWS=1 KESTREL_JAX_DENSE_LN_IN_ROWS=1" || ENV="KESTREL_JAX_DENSE_LN_IN_ROWS=1"; }
  env $ENV timeout $((590 - SECONDS)) python3 tools/benchmark.py --model $M --random-weights \
    --compile-cache /tmp/cc_$run --workloads w1 $ARGS --out $X/4_w1_$run.json 2>&1 \
    | grep -v "$FILT" > $X/4_w1_$run.log
  echo "$run [$ENV] ($SECONDS s): $(grep "w1:\|rror" $X/4_w1_$run.log | cut -c1-150 | tr '\n' ' ')"; save
done
