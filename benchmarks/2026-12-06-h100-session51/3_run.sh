# Run as session 51, call 3 (prepared in session 50 as pending/2_run.sh).
# Prepared in session 50 (2026-12-06): settle KESTREL_JAX_DENSE_IN_ONE_ROW=1 for MD3's four dense
# layers (their joined QKV + fc1 product at one row, tau over its QKV columns). Session 47 (H200):
# step -0.3%; session 50 (H100): probe step -10.4 us (-0.7%) but one W1 pair 770.2 against 785.1.
# Here W1 A B A B on one machine, each run its own process and compile cache; adopt it (ops.
# dense_in_one_row: default on with tau too) only if both B runs beat both A runs. Move this file
# into the session's dated folder before running it.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/3_env.txt
ARGS="--engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
for v in A1 B1 A2 B2; do
  [ $SECONDS -gt 470 ] && { echo "skip W1 $v: $SECONDS s"; continue; }
  ENV="KESTREL_JAX_UNUSED=0"; case $v in B*) ENV="KESTREL_JAX_DENSE_IN_ONE_ROW=1";; esac
  env $ENV timeout $((590 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights \
    --compile-cache /tmp/cc_md3_$v --workloads w1 $ARGS --out $OUT/x/3_md3_w1_$v.json 2>&1 \
    | grep -v "$FILT" > $OUT/x/3_md3_w1_$v.log
  echo "md3 W1 $v ($SECONDS s): $(grep "w1:\|rror" $OUT/x/3_md3_w1_$v.log | head -2 | cut -c1-150 | tr '\n' ' ')"
done
cd $OUT && tar czf 3_all.tgz x && rm -rf x
