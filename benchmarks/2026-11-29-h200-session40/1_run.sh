# Session 40, call 1 (H200): the light-load prefill budget (session 39, CPU-tested only), MD2 W2.
# L = the defaults (3072-token budget, 2048 while fewer than 16 sequences decode);
# N = prefill_light_budget=None (3072 always). C=8: L N L N; C=64: N L. One compile cache.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/1_env.txt
BASE="--requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
declare -A EX=([L]="" [N]="prefill_light_budget=None")
i=0
for run in 8:L 8:N 8:L 8:N 64:N 64:L; do
  c=${run%%:*}; s=${run##*:}; i=$((i+1))
  [ $SECONDS -gt 470 ] && { echo "skip run $i ($run): $SECONDS s"; continue; }
  timeout $((580 - SECONDS)) python3 tools/benchmark.py --model md2 --random-weights \
    --compile-cache /tmp/cc_md2 --workloads w2 --concurrency $c $BASE ${EX[$s]} \
    --out $OUT/x/1_${i}_c${c}_$s.json 2>&1 | grep -v "$FILT" > $OUT/x/1_${i}_c${c}_$s.log
  echo "run $i $run ($SECONDS s): $(grep "w2 C=\|rror" $OUT/x/1_${i}_c${c}_$s.log | cut -c1-150 | tr '\n' ' ')"
done
cd $OUT && gzip x/1_*.json 2>/dev/null; tar czf 1_all.tgz x && rm -rf x
