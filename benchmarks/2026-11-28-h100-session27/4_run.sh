# Session 27, call 4: W2 (C=64) with the vectorized prefix-cache eviction check (HEAD) against the
# per-page Python scan before it (4_old_prefix_cache.py, copied over the package file for the middle
# run): new / old / new, one compile cache. On the CPU, schedule() went 3.8 -> 0.6 ms per step in a
# W2-shaped drive; call 2's W2 spent 2.27 s of 19.6 in schedule (3.0 ms per launch).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/4_env.txt
cp kestrel_jax/serving/prefix_cache.py /tmp/new_prefix_cache.py
i=0
for v in new old new; do
  i=$((i+1))
  [ $SECONDS -gt 470 ] && { echo "skip run $i ($v): $SECONDS s"; continue; }
  if [ $v = old ]; then cp benchmarks/2026-11-28-h100-session27/4_old_prefix_cache.py kestrel_jax/serving/prefix_cache.py
  else cp /tmp/new_prefix_cache.py kestrel_jax/serving/prefix_cache.py; fi
  timeout $((585 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc_w2 \
    --workloads w2 --concurrency 64 --requests-per-client 16 \
    --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1 \
    --out $OUT/x/4_w2_${i}_$v.json 2>&1 | grep -v "$FILT" > $OUT/x/4_w2_${i}_$v.log
  echo "run $i $v ($SECONDS s): $(grep "output tok/s\|rror" $OUT/x/4_w2_${i}_$v.log | cut -c1-420 | head -2 | tr '\n' ' ')"
done
cp /tmp/new_prefix_cache.py kestrel_jax/serving/prefix_cache.py
cd $OUT && tar czf 4_all.tgz x && rm -rf x
