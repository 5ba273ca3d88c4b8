# Session 19, call 4: the in-GEMM quantisation with the row maxima taken elementwise over the K steps
# first and reduced across lanes once per row (call 2 reduced every K step's tile), A/B against the
# quantisation launches at T = 1, 4, 16; then W1 with the defaults (W8A8 at one token) twice.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
timeout 170 python3 tools/bench_moe.py --tokens 1,4,16 --precisions fp8 --no-routing-ab --no-baselines \
  --quant-ab --budget-s 140 --out $OUT/4_moe.json 2>&1 | grep -v "$FILT" > $OUT/4_moe.log
grep "^T=\|FAILED\|MISMATCH" $OUT/4_moe.log
for t in 1 4 16; do grep -A1 "^T= *$t fp8-w8a8" $OUT/4_moe.log | grep kernels | cut -c1-300; done
EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
for i in 1 2; do
  timeout 125 python3 tools/benchmark.py --model md3 --random-weights --workloads w1 \
    --compile-cache /tmp/cc4_$i --engine-args $EA --out $OUT/4_w1_$i.json 2>&1 | grep -v "$FILT" > $OUT/4_w1_$i.log
  echo "W1 run $i: $(grep "batch-1 decode tok/s\|fraction of copy\|rror" $OUT/4_w1_$i.log | head -3 | tr '\n' ' ')"
done
