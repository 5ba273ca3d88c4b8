# Session 14, call 5: call 4 found batch-1 decode drop from 607 to 560 tok/s once the decode step's
# 8- and 16-row variants were loaded (2 and 4 did nothing; 32, 48, 64 nothing more). Which of the
# two, and where do the gaps sit (short gaps by the kernel family that follows them)?
# A: +8, then +16, then a trace; B: the decode_buckets=1 engine's trace alone; C: +16 alone.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
E='decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()'
run() { timeout 200 python3 tools/probe_loaded_modules.py --compile-cache /tmp/cc5 --xla --mosaic --repeats 1 --engine-args $E "$@" 2>&1 | grep -v "$FILT"; }
run --decode-buckets 8 16 --trace-dir /tmp/tr5a --out $OUT/5_a.json > $OUT/5_a.log
run --trace-dir /tmp/tr5b --out $OUT/5_b.json > $OUT/5_b.log
run --decode-buckets 16 --out $OUT/5_c.json > $OUT/5_c.log
grep -h "stage {\|rror\|ready\|trace w1" $OUT/5_*.log | cut -c18-2500
