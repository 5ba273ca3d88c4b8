# Session 13, call 7: does compiling the decode variants alone change batch-1 decode on one machine?
# W1 from two engines with the default decode buckets, each with its own cold compile cache (few
# other buckets, to fit one call): decode_alone off, then on; then off again from its warm cache.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
for run in off on off_warm; do
  A=False; case $run in on) A=True;; esac; D=${run%_warm}
  timeout 240 python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc7_$D --workloads w1 \
    --engine-args decode_alone=$A prefill_token_buckets=1024 runner.vision_buckets=1 "runner.vision_image_batches=()" \
    --out $OUT/7_w1_$run.json 2>&1 | grep -v "$FILT" > $OUT/7_w1_$run.log
done
grep -h "engine ready\|w1:\|rror" $OUT/7_w1_*.log | cut -c18-200
