# Session 26, call 2: W2 (C=64, 16 requests per client) with the sorted MoE GEMMs' units slice
# fastest (the new default, call 1: the W2 prefill step's grouped GEMMs 5,610 -> 4,733 us) against
# block fastest (KESTREL_JAX_MOE_SORTED_ORDER=blocks, the previous default). Settings as session 24's.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/2_env.txt
i=0
for o in slices blocks; do
  i=$((i+1))
  KESTREL_JAX_MOE_SORTED_ORDER=$o timeout 285 python3 tools/benchmark.py --model md3 \
    --random-weights --compile-cache /tmp/cc_w2_$o --workloads w2 --concurrency 64 --requests-per-client 16 \
    --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1 \
    --out $OUT/x/2_w2_${i}_$o.json 2>&1 | grep -v "$FILT" > $OUT/x/2_w2_${i}_$o.log
  echo "run $i order=$o ($SECONDS s): $(grep "output tok/s\|rror" $OUT/x/2_w2_${i}_$o.log | head -3 | tr '\n' ' ')"
done
cd $OUT && tar czf 2_all.tgz x && rm -rf x
