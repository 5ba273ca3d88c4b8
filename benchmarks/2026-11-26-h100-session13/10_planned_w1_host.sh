# Planned for the next GPU session (one call, ~8 min): where the engine thread spends the 23% of
# batch-1 decode during which the GPU idles with the default decode bucket set (session 13: 558 vs
# 605 tok/s on one machine, same device time per launch). W1 with the engine thread's sampler
# (--host-profile) for four decode bucket sets on one machine, each its own cold cache, the other
# buckets small; compare the samplers' innermost frames and the engine_host_s phases.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
for run in d1 d124 d1_32_48_64 dall; do
  case $run in d1) B=1;; d124) B=1,2,4;; d1_32_48_64) B=1,32,48,64;; dall) B=1,2,4,8,16,32,48,64;; esac
  timeout 150 python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc_$run --workloads w1 \
    --host-profile --engine-args decode_buckets=$B prefill_token_buckets=1024 runner.vision_buckets=1 \
    "runner.vision_image_batches=()" --out $OUT/10_w1_$run.json 2>&1 | grep -v "$FILT" > $OUT/10_w1_$run.log
done
grep -h "w1:\|engine thread\|rror" $OUT/10_w1_*.log | cut -c18-300
