export PYTHONPATH=$PWD:$PWD/.scratch/site
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
EA="decode_buckets=1,8,16,32,64 runner.vision_buckets=2"
B="python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc --requests-per-client 8"
rm -rf /tmp/cc
$B --workloads w2 --concurrency 64 --engine-args $EA prefill_token_buckets=1024,2048 --out $OUT/1_A.json --trace-dir /tmp/tr 2>&1 | grep -v "$FILT" > $OUT/1_A.log
$B --workloads w2 --concurrency 64 8 --engine-args $EA prefill_token_buckets=1024 --out $OUT/2_B.json 2>&1 | grep -v "$FILT" > $OUT/2_B.log
$B --workloads w2 --concurrency 64 8 --engine-args $EA prefill_token_buckets=1024 decode_steps=4 --out $OUT/3_C.json 2>&1 | grep -v "$FILT" > $OUT/3_C.log
grep "w2 C=\|engine ready" $OUT/*.log | cut -c1-300
