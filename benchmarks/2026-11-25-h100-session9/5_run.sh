export PYTHONPATH=$PWD:$PWD/.scratch/site
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
EA="decode_buckets=64 prefill_token_buckets=2048 runner.vision_buckets=2"
B="python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc --requests-per-client 6 --host-profile"
rm -rf /tmp/cc
$B --workloads w2 --concurrency 64 --engine-args $EA --out $OUT/1_mixed.json 2>&1 | grep -v "$FILT" > $OUT/1_mixed.log
$B --workloads w2 --concurrency 64 --engine-args $EA "mixed_decode_buckets=()" --out $OUT/2_off.json 2>&1 | grep -v "$FILT" > $OUT/2_off.log
grep "w2 C=\|samples" $OUT/*.log | cut -c1-2500
