# Session 50, call 4: where MD2's 64 concurrent image queries spend an H100 (call 3: 7,702.5 output
# tok/s, 1.43x Kestrel's 5,375.0 in the same call; issue 6's target is 1.5x): W2 at 64 clients with a
# 2 s trace of the steady window, summarised per XLA module and kernel family on the device.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/4_env.txt
ARGS="--engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
timeout 400 python3 tools/benchmark.py --model md2 --random-weights --compile-cache /tmp/cc_md2 \
  --workloads w2 --concurrency 64 --requests-per-client 16 $ARGS --trace-dir /tmp/trace_md2 \
  --out $OUT/x/4_md2_w2_trace.json 2>&1 | grep -v "$FILT" > $OUT/x/4_md2_w2_trace.log
echo "md2 W2 ($SECONDS s): $(grep "w2 C=64\|trace\|rror" $OUT/x/4_md2_w2_trace.log | cut -c1-250 | tr '\n' ' ')"
cd $OUT && gzip -f x/4_md2*.json; tar czf 4_all.tgz x && rm -rf x
