# Session 13, call 5: the vision thread's wait for a full batch of one-crop images
# (vision_batch_wait_ms: 0 = encode at once with whatever is queued; 1000 = only when 4 are queued
# or the engine needs one), MD3 W2 C=64 (then C=8 for two of them), 16 requests per client, W2 bucket set.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
T=200
for run in 0 1000 30 0b 1000b c8_0 c8_1000; do
  C=64; case $run in c8*) C=8;; esac; W=${run#c8_}; W=${W%b}
  timeout $T python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc --workloads w2 \
    --concurrency $C --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 \
    runner.vision_buckets=1 vision_batch_wait_ms=$W --out $OUT/5_w2_$run.json 2>&1 | grep -v "$FILT" > $OUT/5_w2_$run.log
  T=80
done
for run in 0 1000 30 0b 1000b c8_0 c8_1000; do echo "== $run"; grep -h "w2 C\|rror" $OUT/5_w2_$run.log | sed 's/engine thread.*vision/ ... vision/' | cut -c18-270; done
tar czf $OUT/5_w2.tar.gz -C $OUT $(cd $OUT && ls 5_w2_*) && rm $OUT/5_w2_*
