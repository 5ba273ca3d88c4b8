# Session 11, call 5: a 1536-token prefill bucket. Two W2 requests (2 x 740 tokens) fill a 2048-token
# prefill step to 72%; 1536 holds both at 96%. W2 MD3 C=64, A/B/A: prefill buckets 768,2048 (A) and
# 768,1536,2048 (B); vision bucket 1, decode buckets 1,64.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
ARGS="--model md3 --random-weights --requests-per-client 8 --concurrency 64 --workloads w2 --compile-cache /tmp/cc"
for run in a:768,2048 b:768,1536,2048 a2:768,2048; do
  name=${run%%:*}; pb=${run##*:}
  echo "### $name prefill buckets $pb" >> $OUT/5_w2.log
  timeout 150 python3 tools/benchmark.py $ARGS --engine-args decode_buckets=1,64 prefill_token_buckets=$pb runner.vision_buckets=1 --out $OUT/5_$name.json 2>&1 | grep -v "$FILT" >> $OUT/5_w2.log
done
grep -h "###\|engine ready\|w2 C=\|rror" $OUT/5_w2.log | cut -c1-330
