# Session 11, call 1: vision bucket 1 (the one-crop encoding of 1x1 tilings, landed at the end of
# session 10) measured: W2 MD3 C=64, A/B/A with runner.vision_buckets=1 (new) and 2 (the two-crop
# encode of session 10), same process settings otherwise.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
ARGS="--model md3 --random-weights --requests-per-client 8 --concurrency 64 --workloads w2 --compile-cache /tmp/cc"
for run in vb1_a:1 vb2:2 vb1_b:1; do
  name=${run%%:*}; vb=${run##*:}
  echo "### $name" >> $OUT/1_w2.log
  timeout 170 python3 tools/benchmark.py $ARGS --engine-args decode_buckets=1,64 prefill_token_buckets=2048 runner.vision_buckets=$vb --out $OUT/1_$name.json 2>&1 | grep -v "$FILT" >> $OUT/1_w2.log
done
grep -h "###\|engine ready\|num_pages\|w2 C=\|rror" $OUT/1_w2.log | cut -c1-600
