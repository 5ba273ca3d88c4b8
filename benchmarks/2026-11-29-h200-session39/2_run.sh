# Session 39, call 2 (H200): call 1 gave MD2 W2 +3-5% with a 3072-token prefill bucket (four image
# prompts per step, four images per vision call). Here: (1) MD3 W2 with and without it (A = 768,
# 1536, 2048; B = + 3072), A B A B, one compile cache; (2) MD2 with a 4096-token bucket too (five
# prompts per step; vision batches up to 5 images), D = 768, 1536, 3072, 4096, twice.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/2_env.txt
COMMON="--concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 runner.vision_buckets=1"
declare -A BK=([A]=768,1536,2048 [B]=768,1536,2048,3072 [D]="768,1536,3072,4096 runner.vision_image_batches=2,3,4,5")
i=0
for ms in md3:A md3:B md3:A md3:B md2:D md2:D; do
  i=$((i+1)); m=${ms%%:*}; s=${ms##*:}
  [ $SECONDS -gt 500 ] && { echo "skip run $i ($ms): $SECONDS s"; continue; }
  timeout $((585 - SECONDS)) python3 tools/benchmark.py --model $m --random-weights \
    --compile-cache /tmp/cc_$m --workloads w2 $COMMON prefill_token_buckets=${BK[$s]} \
    --out $OUT/x/2_${i}_${m}_$s.json 2>&1 | grep -v "$FILT" > $OUT/x/2_${i}_${m}_$s.log
  echo "run $i $ms ($SECONDS s): $(grep -o "create_s': [0-9.]*" $OUT/x/2_${i}_${m}_$s.log) $(grep "w2 C=64\|rror" $OUT/x/2_${i}_${m}_$s.log | cut -c1-150 | head -2 | tr '\n' ' ') $(grep -o 'vision calls by images {[^}]*}' $OUT/x/2_${i}_${m}_$s.log)"
done
cd $OUT && gzip x/2_*.json 2>/dev/null; tar czf 2_all.tgz x && rm -rf x
