export PYTHONPATH=$PWD:$PWD/.scratch/site
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
EA="decode_buckets=1,8,16,32,64 prefill_token_buckets=1024,2048 runner.vision_buckets=2"
B="python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc"
rm -rf /tmp/cc
$B --workloads w2 --concurrency 64 8 --requests-per-client 8 --engine-args $EA --out $OUT/1_w2_mixed.json 2>&1 | grep -v "$FILT" > $OUT/1_w2_mixed.log
$B --workloads w2 --concurrency 64 8 --requests-per-client 8 --engine-args $EA "mixed_decode_buckets=()" --out $OUT/2_w2_off.json 2>&1 | grep -v "$FILT" > $OUT/2_w2_off.log
$B --workloads w2 --concurrency 64 8 --requests-per-client 8 --engine-args $EA --out $OUT/3_w2_mixed.json 2>&1 | grep -v "$FILT" > $OUT/3_w2_mixed.log
grep "w2 C=\|engine ready" $OUT/*.log | cut -c1-400
