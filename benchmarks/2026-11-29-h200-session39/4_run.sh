# Session 39, call 4 (H200): the 3072-token budget at lower concurrency (issue 6's W2 levels 8 and
# 32), MD2: A = 768, 1536, 2048; B = + 3072; A B, one compile cache.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/4_env.txt
COMMON="--concurrency 8 32 --requests-per-client 16 --engine-args decode_buckets=1,64 runner.vision_buckets=1"
declare -A BK=([A]=768,1536,2048 [B]=768,1536,2048,3072)
i=0
for s in A B; do
  i=$((i+1))
  timeout $((400 - SECONDS)) python3 tools/benchmark.py --model md2 --random-weights \
    --compile-cache /tmp/cc_md2 --workloads w2 $COMMON prefill_token_buckets=${BK[$s]} \
    --out $OUT/x/4_${i}_md2_$s.json 2>&1 | grep -v "$FILT" > $OUT/x/4_${i}_md2_$s.log
  echo "run $i $s ($SECONDS s): $(grep "w2 C=\|rror" $OUT/x/4_${i}_md2_$s.log | cut -c1-120 | tr '\n' ' ')"
done
cd $OUT && gzip x/4_*_md2_*.json 2>/dev/null; tar czf 4_all.tgz x && rm -rf x
