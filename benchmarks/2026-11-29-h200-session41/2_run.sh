# Session 41, call 2 (H200): W2 C=64 with the multi-wave prefill attention shape switched to four
# 64-row consumers (W: KESTREL_JAX_PREFILL_WIDE=4x64; the fortieth session measured the kernel
# alone 1.0-1.6% faster at 16 x 740) against the default (B: two 128-row consumers), MD3 B W B W,
# then MD2 B W; one compile cache per model.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/2_env.txt
COMMON="--concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
declare -A EX=([B]=2x128 [W]=4x64)
i=0
for ms in md3:B md3:W md3:B md3:W md2:B md2:W; do
  i=$((i+1)); m=${ms%%:*}; s=${ms##*:}
  [ $SECONDS -gt 480 ] && { echo "skip run $i ($ms): $SECONDS s"; continue; }
  KESTREL_JAX_PREFILL_WIDE=${EX[$s]} timeout $((585 - SECONDS)) python3 tools/benchmark.py --model $m \
    --random-weights --compile-cache /tmp/cc_$m --workloads w2 $COMMON \
    --out $OUT/x/2_${i}_${m}_$s.json 2>&1 | grep -v "$FILT" > $OUT/x/2_${i}_${m}_$s.log
  echo "run $i $ms ($SECONDS s): $(grep -o "create_s': [0-9.]*" $OUT/x/2_${i}_${m}_$s.log) $(grep "w2 C=64\|rror" $OUT/x/2_${i}_${m}_$s.log | cut -c1-150 | head -2 | tr '\n' ' ')"
done
cd $OUT && gzip x/2_*.json 2>/dev/null; tar czf 2_all.tgz x && rm -rf x
