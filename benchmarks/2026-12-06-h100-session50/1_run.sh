# Session 50, call 1: the region heads under a lax.cond (KESTREL_JAX_REGION_COND=1, opt-in; its
# import adds --xla_gpu_enable_command_buffer=+CONDITIONAL so the predicate stays on the device).
# Probe (one process started with the switch, so the flag is in effect for every set): the switch
# off / on / on + KESTREL_JAX_DENSE_IN_ONE_ROW=1 (MD3's dense layers' joined input product, -0.3%
# in session 47). Then a W1 pair (A: defaults, no flag; B: the switch), then the tiny-model GPU
# smoke with the switch (engine outputs, jnp-reference kernels against Pallas kernels).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/1_env.txt
KESTREL_JAX_REGION_COND=1 timeout 200 python3 tools/probe_step_kernels.py --kernels 45 --top 30 --model md3 \
  --kinds decode --batch 1 --sets KESTREL_JAX_REGION_COND=0 KESTREL_JAX_REGION_COND=1 \
  KESTREL_JAX_REGION_COND=1+KESTREL_JAX_DENSE_IN_ONE_ROW=1 --json $OUT/x/1_probe_md3.json 2>&1 \
  | grep -v "$FILT" > $OUT/x/1_probe_md3.log
echo "probe ($SECONDS s):"; grep "^\[.*\] decode:\|rror\|XLA_FLAGS" $OUT/x/1_probe_md3.log | cut -c1-200
ARGS="--engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
for v in B A; do
  [ $SECONDS -gt $([ $v = B ] && echo 300 || echo 420) ] && { echo "skip W1 $v: $SECONDS s"; continue; }
  ENV="KESTREL_JAX_UNUSED=0"; [ $v = B ] && ENV="KESTREL_JAX_REGION_COND=1"
  env $ENV timeout $((550 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights \
    --compile-cache /tmp/cc_md3_$v --workloads w1 $ARGS --out $OUT/x/1_md3_w1_$v.json 2>&1 \
    | grep -v "$FILT" > $OUT/x/1_md3_w1_$v.log
  echo "md3 W1 $v ($SECONDS s): $(grep "w1:\|rror" $OUT/x/1_md3_w1_$v.log | cut -c1-150 | tr '\n' ' ')"
done
[ $SECONDS -lt 470 ] && KESTREL_JAX_REGION_COND=1 timeout $((590 - SECONDS)) python3 tools/gpu_smoke.py --full "" \
  --out $OUT/x/1_smoke.json 2>&1 | grep -v "$FILT" > $OUT/x/1_smoke.log
echo "smoke ($SECONDS s): $(grep -i "equal\|rror\|FAIL" $OUT/x/1_smoke.log | head -5 | cut -c1-200 | tr '\n' ' ')"
cd $OUT && tar czf 1_all.tgz x && rm -rf x
