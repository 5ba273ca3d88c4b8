# Session 26, call 4: call 2 again in the other order (blocks first). Call 3: the W2 mixed step
# (two 740-token prompts + 64 decode rows) took 18,073 us with the sorted MoE units slice fastest vs
# 19,060 block fastest (-5.2%), yet call 2's W2 pair showed no change (6,782 vs 6,826 tok/s).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/4_env.txt
i=0
for o in blocks slices; do
  i=$((i+1))
  KESTREL_JAX_MOE_SORTED_ORDER=$o timeout 285 python3 tools/benchmark.py --model md3 \
    --random-weights --compile-cache /tmp/cc_w2_$o --workloads w2 --concurrency 64 --requests-per-client 16 \
    --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1 \
    --out $OUT/x/4_w2_${i}_$o.json 2>&1 | grep -v "$FILT" > $OUT/x/4_w2_${i}_$o.log
  echo "run $i order=$o ($SECONDS s): $(grep "output tok/s\|rror" $OUT/x/4_w2_${i}_$o.log | head -3 | tr '\n' ' ')"
done
cd $OUT && tar czf 4_all.tgz x && rm -rf x
