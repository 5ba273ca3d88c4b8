# Session 17, call 9: the routing-table program's packed-key top-k (bf16 logits: one max reduction
# per pick) against the two-reduction path (the same logits as f32), then W1 with every change of
# the session.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
timeout 60 python3 tools/bench_route_tables.py --warps 4 8 --rows 1 8 --out $OUT/9_route.json 2>&1 | grep -v "$FILT" > $OUT/9_route.log
EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
timeout 110 python3 tools/benchmark.py --model md3 --random-weights --workloads w1 --compile-cache /tmp/cc \
  --engine-args $EA --out $OUT/9_w1.json 2>&1 | grep -v "$FILT" > $OUT/9_w1.log
cat $OUT/9_route.log; grep -h "w1:\|rror" $OUT/9_w1.log | cut -c1-200
