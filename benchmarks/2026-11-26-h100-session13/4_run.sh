# Session 13, call 4: one-crop images encoded together on the vision thread (runner.vision_image_batches,
# default (2, 3, 4)) off / on / off / on, MD3 W2 C=64, 16 requests per client, W2 bucket set.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
for run in off on off2 on2; do
  EA=""; case $run in off*) EA="runner.vision_image_batches=()";; esac
  timeout 140 python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc --workloads w2 \
    --concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 \
    runner.vision_buckets=1 $EA --out $OUT/4_w2_$run.json 2>&1 | grep -v "$FILT" > $OUT/4_w2_$run.log
done
grep -h "engine ready\|w2 C\|rror" $OUT/4_w2_*.log | cut -c1-250
