# Session 14, call 1: where the engine thread spends batch-1 decode with the default decode bucket
# set vs decode_buckets=1 (session 13: 558 vs 605 tok/s on one machine, same device time per
# launch). W1 with the engine thread's sampler (--host-profile) and its loop phases, for the full
# set, 1, and the set split in two; each its own cold cache; other buckets small.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
for run in dall d1 d124 d1_32_48_64; do
  case $run in d1) B=1; T=120;; d124) B=1,2,4; T=120;; d1_32_48_64) B=1,32,48,64; T=150;; dall) B=1,2,4,8,16,32,48,64; T=220;; esac
  timeout $T python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc_$run --workloads w1 \
    --host-profile --engine-args decode_buckets=$B prefill_token_buckets=1024 runner.vision_buckets=1 \
    "runner.vision_image_batches=()" --out $OUT/1_w1_$run.json 2>&1 | grep -v "$FILT" > $OUT/1_w1_$run.log
done
grep -h "w1:\|engine thread\|rror" $OUT/1_w1_*.log | cut -c18-600
