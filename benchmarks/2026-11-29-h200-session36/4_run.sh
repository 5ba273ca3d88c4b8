# Session 36, call 4 (H200): the joined output projection + fc2 product (default since call 3) measured
# +1.2% on MD2 W2 on call 2's machine; the same A/B again on another machine: MD2 W2 C=64,
# KESTREL_JAX_DENSE_OUT_JOINED=0 / default, alternated (own compile caches).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/4_env.txt
W2="--concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1"
i=0
for j in 0 1 0 1 0 1; do
  i=$((i+1))
  [ $SECONDS -gt 370 ] && { echo "skip run $i (out=$j): $SECONDS s"; continue; }
  timeout $((440 - SECONDS)) env KESTREL_JAX_DENSE_OUT_JOINED=$j python3 tools/benchmark.py --model md2 --random-weights \
    --compile-cache /tmp/cc_md2_$j --workloads w2 $W2 --out $OUT/x/4_${i}_md2_out$j.json 2>&1 \
    | grep -v "$FILT" > $OUT/x/4_${i}_md2_out$j.log
  echo "run $i out=$j ($SECONDS s): $(grep "w2 C=64\|rror\|joined" $OUT/x/4_${i}_md2_out$j.log | cut -c1-150 | head -3 | tr '\n' ' ')"
done
cd $OUT && gzip x/4_*_md2_*.json; tar czf 4_all.tgz x && rm -rf x
