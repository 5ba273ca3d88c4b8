# Session 13, call 9: which part of the decode bucket set slows batch-1 decode (W1)? One machine, each
# run its own cold cache: decode_buckets=1 (output rows 9), =1,64 (output rows 72, a 64-row decode
# step beside it), and =1 with mixed_decode_buckets=64 (output rows 72, no 64-row decode step).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
for run in d1 d1_64 d1_m64; do
  case $run in d1) EA="decode_buckets=1";; d1_64) EA="decode_buckets=1,64";; d1_m64) EA="decode_buckets=1 mixed_decode_buckets=64";; esac
  timeout 170 python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc9_$run --workloads w1 \
    --engine-args $EA prefill_token_buckets=1024 runner.vision_buckets=1 "runner.vision_image_batches=()" \
    --out $OUT/9_w1_$run.json 2>&1 | grep -v "$FILT" > $OUT/9_w1_$run.log
done
grep -h "w1:\|rror" $OUT/9_w1_*.log | cut -c18-200
