# Session 22, call 2: L2 prefetch from decode attention (KESTREL_JAX_L2_PREFETCH bit mask: 1 the output
# projection's weight, 2 the selected experts' up weights). Hidden states on vs off; the batch-1 step
# A/B (CUPTI + wall) at 0 / 1 / 2 / 3; W1 at 0 and 3 (dense-projection gemv now on by default).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
timeout 90 python3 tools/check_decode_fusion.py --switch KESTREL_JAX_L2_PREFETCH=3,0 --batches 1 4 \
  --out $OUT/x/2_fusion.json 2>&1 | grep -v "$FILT" > $OUT/x/2_fusion.log
tail -4 $OUT/x/2_fusion.log
timeout 230 python3 tools/probe_step_kernels.py --kernels 30 --model md3 --kinds decode --batch 1 \
  --ab KESTREL_JAX_L2_PREFETCH=0,1,2,3 --json $OUT/x/2_probe1.json 2>&1 | grep -v "$FILT" > $OUT/x/2_probe1.log
grep "^decode\|^\[" $OUT/x/2_probe1.log
grep -A12 "^decode:" $OUT/x/2_probe1.log | head -60
EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
i=0
for s in 3 0; do
  i=$((i+1))
  KESTREL_JAX_L2_PREFETCH=$s timeout 110 python3 tools/benchmark.py --model md3 --random-weights --workloads w1 \
    --compile-cache /tmp/cc_$i --engine-args $EA --out $OUT/x/2_w1_${i}_pf$s.json 2>&1 | grep -v "$FILT" > $OUT/x/2_w1_${i}_pf$s.log
  echo "run $i prefetch=$s: $(grep "batch-1 decode tok/s\|rror" $OUT/x/2_w1_${i}_pf$s.log | head -3 | tr '\n' ' ')"
done
cd $OUT && tar czf 2_all.tgz x && rm -rf x
