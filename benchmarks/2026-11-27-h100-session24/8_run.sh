# Session 24, call 8: MD2 W2 (C=64) with KESTREL_JAX_REGION_GATE=1 + KESTREL_JAX_HEADS_BARRIER=1 and
# without (call 5: MD2 W1 +3.5%).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
i=0
for s in 1 0; do
  i=$((i+1))
  KESTREL_JAX_REGION_GATE=$s KESTREL_JAX_HEADS_BARRIER=$s timeout 285 python3 tools/benchmark.py --model md2 \
    --random-weights --compile-cache /tmp/cc_md2_w2_$s --workloads w2 --concurrency 64 --requests-per-client 16 \
    --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1 \
    --out $OUT/x/8_md2_w2_${i}_s$s.json 2>&1 | grep -v "$FILT" > $OUT/x/8_md2_w2_${i}_s$s.log
  echo "run $i switches=$s ($SECONDS s): $(grep "output tok/s\|rror" $OUT/x/8_md2_w2_${i}_s$s.log | head -3 | tr '\n' ' ')"
done
cd $OUT && tar czf 8_all.tgz x && rm -rf x
