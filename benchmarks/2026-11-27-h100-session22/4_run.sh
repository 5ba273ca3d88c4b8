# Session 22, call 4: W2 (C=64) with the MoE layers' QKV + router through gemv_rows at up to 64 rows
# (KESTREL_JAX_GEMV_QKV_ROWS=64) against the default (1), one compile cache for both (only the
# pure-decode steps differ); then, if time is left, W1 with every default (L2 prefetch 14 now).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
i=0
for q in 64 1; do
  i=$((i+1))
  KESTREL_JAX_GEMV_QKV_ROWS=$q timeout $((i == 1 ? 300 : 200)) python3 tools/benchmark.py --model md3 --random-weights \
    --compile-cache /tmp/cc --workloads w2 --concurrency 64 --requests-per-client 16 \
    --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1 \
    --out $OUT/x/4_w2_${i}_q$q.json 2>&1 | grep -v "$FILT" > $OUT/x/4_w2_${i}_q$q.log
  echo "run $i qkv_rows=$q ($SECONDS s): $(grep -h "engine ready\|w2 C\|rror" $OUT/x/4_w2_${i}_q$q.log | cut -c1-260 | tr '\n' ' ')"
done
if [ $SECONDS -lt 440 ]; then
  EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
  timeout 120 python3 tools/benchmark.py --model md3 --random-weights --workloads w1 \
    --compile-cache /tmp/cc_w1 --engine-args $EA --out $OUT/x/4_w1.json 2>&1 | grep -v "$FILT" > $OUT/x/4_w1.log
  echo "W1 all defaults: $(grep "batch-1 decode tok/s\|rror" $OUT/x/4_w1.log | head -3 | tr '\n' ' ')"
fi
cd $OUT && tar czf 4_all.tgz x && rm -rf x
