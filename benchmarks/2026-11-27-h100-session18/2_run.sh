# Session 18, call 2: the fused UP + DOWN launch measured slower than the two GEMMs with clusters of
# 8 (call 1: 40.7 vs 25.4 us of kernels at T=1). Cluster sizes 8 / 4 / 2 (the exchange's loads now
# all issued before the stores), then W1 with clusters of 2 and 4 against off.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
timeout 150 python3 tools/bench_moe.py --tokens 1,2 --precisions fp8 --no-routing-ab --no-baselines --fused-ab \
  --out $OUT/2_moe.json 2>&1 | grep -v "$FILT" > $OUT/2_moe.log
EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
for run in 2 0 4; do
  export KESTREL_JAX_MOE_FUSED=$run
  echo "### cluster $run" >> $OUT/2_w1.log
  timeout 110 python3 tools/benchmark.py --model md3 --random-weights --workloads w1 --compile-cache /tmp/cc_$run \
    --engine-args $EA --out /tmp/2_w1_$run.json 2>&1 | grep -v "$FILT" >> $OUT/2_w1.log
done
grep "^T=" $OUT/2_moe.log; grep -A1 "c2\|c4" $OUT/2_moe.log | grep kernels | cut -c1-400; grep -h "###\|w1:\|rror" $OUT/2_w1.log | cut -c1-200
