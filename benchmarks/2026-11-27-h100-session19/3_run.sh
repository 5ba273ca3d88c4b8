# Session 19, call 3: W1 (batch-1 decode) with W8A8 at one token (the new default: rows and activation
# quantised inside the GEMMs) vs W8A16 at one token (KESTREL_JAX_W8A8_MIN_TOKENS=2, the old default),
# new / old / new / old, each its own process and cold compile cache.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
i=0
for mt in 1 2 1 2; do
  i=$((i+1))
  KESTREL_JAX_W8A8_MIN_TOKENS=$mt timeout 125 python3 tools/benchmark.py --model md3 --random-weights --workloads w1 \
    --compile-cache /tmp/cc_$i --engine-args $EA --out $OUT/3_w1_${i}_mt$mt.json 2>&1 | grep -v "$FILT" > $OUT/3_w1_${i}_mt$mt.log
  echo "run $i min_tokens=$mt: $(grep "batch-1 decode tok/s\|rror" $OUT/3_w1_${i}_mt$mt.log | head -3 | tr '\n' ' ')"
done
