# Session 24, call 5: MD2 W1 (batch-1 decode) with this session's new defaults (region gate and
# heads barrier on: MD2's region decoder MLPs skip their weight streams in text-only steps) and
# with both off, A B A.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
i=0
for s in 1 0 1; do
  i=$((i+1))
  KESTREL_JAX_REGION_GATE=$s KESTREL_JAX_HEADS_BARRIER=$s timeout 170 python3 tools/benchmark.py --model md2 \
    --random-weights --workloads w1 --compile-cache /tmp/cc_$s --engine-args $EA \
    --out $OUT/x/5_md2_w1_${i}_s$s.json 2>&1 | grep -v "$FILT" > $OUT/x/5_md2_w1_${i}_s$s.log
  echo "run $i switches=$s ($SECONDS s): $(grep "batch-1 decode tok/s\|rror" $OUT/x/5_md2_w1_${i}_s$s.log | head -3 | tr '\n' ' ')"
done
cd $OUT && tar czf 5_all.tgz x && rm -rf x
