# Session 21, call 5: call 4's W1 A/B repeated (region heads through the decode GEMM kernel on / off).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
i=0
for s in 0 8; do
  i=$((i+1))
  KESTREL_JAX_GEMV_REGION_ROWS=$s timeout 110 python3 tools/benchmark.py --model md3 --random-weights --workloads w1 \
    --compile-cache /tmp/cc_$i --engine-args $EA --out $OUT/x/5_w1_${i}_rr$s.json 2>&1 | grep -v "$FILT" > $OUT/x/5_w1_${i}_rr$s.log
  echo "run $i region_rows=$s: $(grep "batch-1 decode tok/s\|rror" $OUT/x/5_w1_${i}_rr$s.log | head -3 | tr '\n' ' ')"
done
cd $OUT && tar czf 5_all.tgz x && rm -rf x
