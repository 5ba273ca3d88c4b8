# Session 27, call 5: W2 (C=64) with the tail-page copies launched right after the step that cached
# the image (HEAD) against the copy launched before the next step (5_old_loop.py / 5_old_stepper.py
# copied over the package files for the middle run); both with the vectorized prefix-cache eviction
# check (call 4). new / old / new, one compile cache.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
D=benchmarks/2026-11-28-h100-session27
mkdir -p $OUT/x /tmp/new
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/5_env.txt
cp kestrel_jax/serving/loop.py kestrel_jax/serving/stepper.py /tmp/new/
i=0
for v in new old new; do
  i=$((i+1))
  [ $SECONDS -gt 330 ] && { echo "skip run $i ($v): $SECONDS s"; continue; }
  if [ $v = old ]; then cp $D/5_old_loop.py kestrel_jax/serving/loop.py; cp $D/5_old_stepper.py kestrel_jax/serving/stepper.py
  else cp /tmp/new/loop.py /tmp/new/stepper.py kestrel_jax/serving/; fi
  timeout $((470 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc_w2 \
    --workloads w2 --concurrency 64 --requests-per-client 16 \
    --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1 \
    --out $OUT/x/5_w2_${i}_$v.json 2>&1 | grep -v "$FILT" > $OUT/x/5_w2_${i}_$v.log
  echo "run $i $v ($SECONDS s): $(grep "output tok/s\|rror" $OUT/x/5_w2_${i}_$v.log | cut -c1-420 | head -2 | tr '\n' ' ')"
done
cp /tmp/new/loop.py /tmp/new/stepper.py kestrel_jax/serving/
cd $OUT && tar czf 5_all.tgz x && rm -rf x
