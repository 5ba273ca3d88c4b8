# Session 14, call 4: call 3 found no slowdown from 64 extra XLA programs and 192 extra Mosaic
# kernels. Does loading the engine's own decode step at more buckets (2,4 / 8,16 / 32,48,64, 1 and
# 8 iterations each) slow batch-1 decode in a decode_buckets=1 engine (72 output rows, as the
# default set's)? Then, as a control on this machine, a default-set engine's W1.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
timeout 300 python3 tools/probe_loaded_modules.py --compile-cache /tmp/cc4 --decode-buckets 2,4 8,16 32,48,64 --xla --mosaic \
  --engine-args decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 \
  "runner.vision_image_batches=()" --out $OUT/4_probe.json 2>&1 | grep -v "$FILT" > $OUT/4_probe.log
timeout 200 python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc4_dall --workloads w1 \
  --engine-args decode_buckets=1,2,4,8,16,32,48,64 prefill_token_buckets=1024 runner.vision_buckets=1 \
  "runner.vision_image_batches=()" --out $OUT/4_w1_dall.json 2>&1 | grep -v "$FILT" > $OUT/4_w1_dall.log
grep -h "stage\|rror\|ready\|w1:" $OUT/4_*.log | cut -c18-400
