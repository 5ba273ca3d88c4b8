# Session 34, call 4 (H200): call 3 measured the prefill QKV epilogue kernel bit-identical to the
# XLA path and the MD2 mixed step -247 us (-1.6%), prefill step -367 us (-2.9%), MD3 prefill -363 us
# (-2.5%). Now MD2 W2 C=64 with it off / on / off / on (KESTREL_JAX_PREFILL_QKV_KERNEL; each
# setting its own compile cache: runs 1-2 cold, 3-4 warm), W2 settings as sessions 32-33.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/4_env.txt
W2="--concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1"
i=0
for v in 0 1 0 1; do
  i=$((i+1))
  [ $SECONDS -gt 470 ] && { echo "skip run $i ($v): $SECONDS s"; continue; }
  KESTREL_JAX_PREFILL_QKV_KERNEL=$v timeout $((585 - SECONDS)) python3 tools/benchmark.py --model md2 --random-weights \
    --compile-cache /tmp/cc_md2_$v --workloads w2 $W2 --out $OUT/x/4_${i}_md2_k$v.json 2>&1 | grep -v "$FILT" > $OUT/x/4_${i}_md2_k$v.log
  echo "run $i k=$v ($SECONDS s): $(grep "w2 C=64\|rror" $OUT/x/4_${i}_md2_k$v.log | cut -c1-150 | head -2 | tr '\n' ' ')"
done
cd $OUT && tar czf 4_all.tgz x && rm -rf x
