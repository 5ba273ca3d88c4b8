# Session 20, call 1: the routing tables computed inside the QKV epilogue's launch (opt-in
# KESTREL_JAX_ROUTE_IN_QKV=1, built in session 19, not yet measured): full-size forward on vs off
# (bit-identity), W1 on / off / on / off (each its own process and cold compile cache), then the
# batch-1 decode step kernel by kernel with it on (CUPTI).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/1_env.txt
timeout 90 python3 tools/check_decode_fusion.py --switch KESTREL_JAX_ROUTE_IN_QKV --batches 1 2 \
  --out $OUT/1_check.json 2>&1 | grep -v "$FILT" > $OUT/1_check.log
tail -3 $OUT/1_check.log
EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
i=0
for rq in 1 0 1 0; do
  i=$((i+1))
  KESTREL_JAX_ROUTE_IN_QKV=$rq timeout 115 python3 tools/benchmark.py --model md3 --random-weights --workloads w1 \
    --compile-cache /tmp/cc_$i --engine-args $EA --out $OUT/1_w1_${i}_rq$rq.json 2>&1 | grep -v "$FILT" > $OUT/1_w1_${i}_rq$rq.log
  echo "run $i route_in_qkv=$rq: $(grep "batch-1 decode tok/s\|rror" $OUT/1_w1_${i}_rq$rq.log | head -3 | tr '\n' ' ')"
done
KESTREL_JAX_ROUTE_IN_QKV=1 timeout 80 python3 tools/probe_step_kernels.py --kernels 24 --model md3 --kinds decode --batch 1 2>&1 \
  | grep -v "$FILT" > $OUT/1_probe.log
head -30 $OUT/1_probe.log
