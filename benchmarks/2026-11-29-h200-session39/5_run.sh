# Session 39, call 5 (H200, the session's last minutes): call 4's C=8 pair repeated (MD2; A = 768,
# 1536, 2048; B = + 3072), A B A B with one compile cache, runs skipped past 200 s.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
COMMON="--concurrency 8 --requests-per-client 16 --engine-args decode_buckets=1,64 runner.vision_buckets=1"
declare -A BK=([A]=768,1536,2048 [B]=768,1536,2048,3072)
i=0
for s in A B A B; do
  i=$((i+1))
  [ $SECONDS -gt 200 ] && { echo "skip run $i ($s): $SECONDS s"; continue; }
  timeout $((250 - SECONDS)) python3 tools/benchmark.py --model md2 --random-weights \
    --compile-cache /tmp/cc_md2 --workloads w2 $COMMON prefill_token_buckets=${BK[$s]} \
    --out $OUT/x/5_${i}_md2_$s.json 2>&1 | grep -v "$FILT" > $OUT/x/5_${i}_md2_$s.log
  echo "run $i $s ($SECONDS s): $(grep "w2 C=\|rror" $OUT/x/5_${i}_md2_$s.log | cut -c1-120 | tr '\n' ' ')"
done
cd $OUT && gzip x/5_*_md2_*.json 2>/dev/null; tar czf 5_all.tgz x && rm -rf x
