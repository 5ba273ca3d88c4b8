# Session 17, call 8: W2 at 64 clients after this session's changes (the 768-token prefill bucket now
# runs the prefill attention with three 64-row consumers; the batch-1 changes do not reach the
# 64-row decode steps), W2 bucket set as sessions 12-13.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
timeout 280 python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc --workloads w2 \
  --concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 \
  runner.vision_buckets=1 --out $OUT/8_w2.json 2>&1 | grep -v "$FILT" > $OUT/8_w2.log
grep -h "engine ready\|w2 C\|rror" $OUT/8_w2.log | cut -c1-300
