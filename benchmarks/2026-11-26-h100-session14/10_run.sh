# Session 14, call 10: in the slow state nearly every kernel follows an idle gap, in the fast state
# ~40% start with none (overlapping or concurrent launches). Hypothesis: the extra decode variants
# make the process create more CUDA streams than the hardware work queues CUDA maps them onto
# (CUDA_DEVICE_MAX_CONNECTIONS, default 8), so streams share queues and lose their overlap.
# A: call 4's reproduction with 32 connections; B: a default-set engine's W1 with 32 connections.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
E='decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()'
CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 200 python3 tools/probe_loaded_modules.py --compile-cache /tmp/cc10 --xla --mosaic \
  --decode-buckets 2,4 8,16 --engine-args $E --out $OUT/10_probe_conn32.json 2>&1 | grep -v "$FILT" > $OUT/10_probe_conn32.log
grep -h "stage {\|stage failed" $OUT/10_probe_conn32.log | cut -c18-300
CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 200 python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc10_dall \
  --workloads w1 --engine-args decode_buckets=1,2,4,8,16,32,48,64 prefill_token_buckets=1024 runner.vision_buckets=1 \
  "runner.vision_image_batches=()" --out $OUT/10_w1_dall_conn32.json 2>&1 | grep -v "$FILT" > $OUT/10_w1_dall_conn32.log
grep -h "w1:" $OUT/10_w1_dall_conn32.log | cut -c18-200
