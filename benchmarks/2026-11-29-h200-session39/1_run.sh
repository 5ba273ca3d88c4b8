# Session 39, call 1 (H200): MD2 W2 with a prefill token budget that holds four image prompts.
# In every MD2 W2 run of session 38 the vision thread encoded ~2 images per call ({2: 466-482} of
# ~520 calls): each prefill step takes two 740-token prompts (budget 2048), so requests arrive,
# finish and are encoded in pairs. A 3072-token bucket lets one step take four prompts (2,964
# tokens), their images encoded in one call (4 images: 1.79 ms per image against ~2.15 at 2,
# session 25's vision-step table), and the prefill GEMMs run over twice the rows.
# A = default W2 buckets (768, 1536, 2048), B = + 3072, C = 768, 1536, 3072; A B C A B C, one
# compile cache for all (B and C add only their new variants).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/1_env.txt
COMMON="--concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 runner.vision_buckets=1"
declare -A BK=([A]=768,1536,2048 [B]=768,1536,2048,3072 [C]=768,1536,3072)
i=0
for s in A B C A B C; do
  i=$((i+1))
  [ $SECONDS -gt 500 ] && { echo "skip run $i ($s): $SECONDS s"; continue; }
  timeout $((585 - SECONDS)) python3 tools/benchmark.py --model md2 --random-weights \
    --compile-cache /tmp/cc_md2 --workloads w2 $COMMON prefill_token_buckets=${BK[$s]} \
    --out $OUT/x/1_${i}_md2_$s.json 2>&1 | grep -v "$FILT" > $OUT/x/1_${i}_md2_$s.log
  echo "run $i $s ($SECONDS s): $(grep -o "create_s': [0-9.]*" $OUT/x/1_${i}_md2_$s.log) $(grep "w2 C=64\|rror" $OUT/x/1_${i}_md2_$s.log | cut -c1-150 | head -2 | tr '\n' ' ') $(grep -o 'vision calls by images {[^}]*}' $OUT/x/1_${i}_md2_$s.log)"
done
cd $OUT && gzip x/1_*_md2_*.json 2>/dev/null; tar czf 1_all.tgz x && rm -rf x
