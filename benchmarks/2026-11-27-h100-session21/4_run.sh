# Session 21, call 4: the region heads (MD3: coordinate and size encoders, the two decoders) through
# the decode GEMM kernel at <= 8 rows (KESTREL_JAX_GEMV_REGION_ROWS, default 8; 0 = XLA, which at
# one row rewrites each product into a multiply + reduce). Batch-1 step A/B (CUPTI), W1 on / off.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
timeout 140 python3 tools/probe_step_kernels.py --kernels 30 --model md3 --kinds decode --batch 1 \
  --ab KESTREL_JAX_GEMV_REGION_ROWS=0,8 --json $OUT/x/4_probe.json 2>&1 | grep -v "$FILT" > $OUT/x/4_probe.log
grep -A16 "^decode:" $OUT/x/4_probe.log
EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
i=0
for s in 8 0; do
  i=$((i+1))
  KESTREL_JAX_GEMV_REGION_ROWS=$s timeout 110 python3 tools/benchmark.py --model md3 --random-weights --workloads w1 \
    --compile-cache /tmp/cc_$i --engine-args $EA --out $OUT/x/4_w1_${i}_rr$s.json 2>&1 | grep -v "$FILT" > $OUT/x/4_w1_${i}_rr$s.log
  echo "run $i region_rows=$s: $(grep "batch-1 decode tok/s\|rror" $OUT/x/4_w1_${i}_rr$s.log | head -3 | tr '\n' ' ')"
done
cd $OUT && tar czf 4_all.tgz x && rm -rf x
