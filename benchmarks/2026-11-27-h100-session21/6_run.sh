# Session 21, call 6: every default after the session's commits (region heads through the decode
# GEMM kernel; the opt-in fused MoE launch and the LayerNorm kernel's quantised rows removed): W1,
# then the 64-row decode step kernel by kernel (CUPTI) for the record.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
timeout 110 python3 tools/benchmark.py --model md3 --random-weights --workloads w1 \
  --compile-cache /tmp/cc_1 --engine-args $EA --out $OUT/x/6_w1.json 2>&1 | grep -v "$FILT" > $OUT/x/6_w1.log
echo "W1: $(grep "batch-1 decode tok/s\|rror" $OUT/x/6_w1.log | head -3 | tr '\n' ' ')"
timeout 100 python3 tools/probe_step_kernels.py --kernels 30 --model md3 --kinds decode --batch 64 \
  --json $OUT/x/6_probe64.json 2>&1 | grep -v "$FILT" > $OUT/x/6_probe64.log
head -24 $OUT/x/6_probe64.log
cd $OUT && tar czf 6_all.tgz x && rm -rf x
