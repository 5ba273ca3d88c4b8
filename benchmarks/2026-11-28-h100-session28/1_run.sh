# Session 28, call 1: RunnerConfig.put_inputs (built last session, unmeasured): the text steps' numpy
# inputs put on the device in one device_put before each step call. W2 (C=64) off / on / off / on in
# one compile cache (put_inputs is not in the export salt: both share the executables), then the
# probe's decode K=1 and mixed launch times with and without --put-inputs.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/1_env.txt
i=0
for v in off on off on; do
  i=$((i+1))
  [ $SECONDS -gt 330 ] && { echo "skip run $i ($v): $SECONDS s"; continue; }
  timeout $((420 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc_w2 \
    --workloads w2 --concurrency 64 --requests-per-client 16 \
    --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1 \
      runner.put_inputs=$([ $v = on ] && echo True || echo False) \
    --out $OUT/x/1_w2_${i}_$v.json 2>&1 | grep -v "$FILT" > $OUT/x/1_w2_${i}_$v.log
  echo "run $i $v ($SECONDS s): $(grep "output tok/s\|rror" $OUT/x/1_w2_${i}_$v.log | cut -c1-420 | head -2 | tr '\n' ' ')"
done
for k in "decode --steps 1 --put-inputs" "decode --steps 1" "mixed --put-inputs" "mixed"; do
  [ $SECONDS -gt 500 ] && { echo "skip probe $k: $SECONDS s"; continue; }
  n=$(echo $k | tr -d ' -')
  timeout $((590 - SECONDS)) python3 tools/probe_step_kernels.py --kernels 8 --top 8 --model md3 --kinds $k \
    --wall-rounds 10 --json $OUT/x/1_probe_$n.json 2>&1 | grep -v "$FILT" > $OUT/x/1_probe_$n.log
  echo "probe $k ($SECONDS s): $(grep "launches (" $OUT/x/1_probe_$n.log | head -2)"; grep -i "Traceback\|Error" $OUT/x/1_probe_$n.log | head -3
done
cd $OUT && tar czf 1_all.tgz x && rm -rf x
