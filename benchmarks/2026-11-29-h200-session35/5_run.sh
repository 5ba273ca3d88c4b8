# Session 35, call 5 (H200): call 4 measured the joined dense decode weights at -32 us per 64-row
# MD2 decode step (the merged GEMM 22.5 -> 19.4 us per layer, GELU and projection slower) and
# +22.8 us at one row (now not used at one row), and MD2 W2 off / on / off / on 9,284 / 9,451 / 9,354 /
# 9,436. More alternations to tell that from noise: (1) decode step at 1 row on / off (must now be
# the same program); (2) MD2 W2 C=64 off / on, then warm off / on / off / on (own compile caches).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/5_env.txt
for f in off on; do
  timeout 100 python3 tools/probe_step_kernels.py --kernels 20 --top 20 --model md2 --kinds decode --fused-dense-decode $f \
    --batch 1 --context 800 --wall-rounds 3 --json $OUT/x/5_probe_b1_$f.json 2>&1 | grep -v "$FILT" > $OUT/x/5_probe_b1_$f.log
  echo "probe b1 fused $f ($SECONDS s): $(grep "launches (\|rror" $OUT/x/5_probe_b1_$f.log | cut -c1-160)"
done
W2="--concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1"
i=0
for f in off on off on off on; do
  i=$((i+1))
  [ $SECONDS -gt 430 ] && { echo "skip run $i ($f): $SECONDS s"; continue; }
  timeout $((480 - SECONDS)) python3 tools/benchmark.py --model md2 --random-weights \
    --compile-cache /tmp/cc_md2_$f --workloads w2 $W2 runner.fused_dense_decode=$f --out $OUT/x/5_${i}_md2_$f.json 2>&1 \
    | grep -v "$FILT" > $OUT/x/5_${i}_md2_$f.log
  echo "run $i fused=$f ($SECONDS s): $(grep "w2 C=64\|rror" $OUT/x/5_${i}_md2_$f.log | cut -c1-150 | head -2 | tr '\n' ' ')"
done
cd $OUT && gzip x/5_*_md2_*.json; tar czf 5_all.tgz x && rm -rf x
