# Session 10, call 2: vision_thread A/B/A on W2 (C=64 and 8), then a W2 trace with vision_thread on.
# Output files renamed on copy: 2_von_a, 2_voff, 2_von_b_trace.
export PYTHONPATH=$PWD:$PWD/.scratch/site
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
EA="decode_buckets=1,64 prefill_token_buckets=2048 runner.vision_buckets=2"
B="python3 tools/benchmark.py --model md3 --random-weights --requests-per-client 8 --host-profile --concurrency 64 8 --compile-cache /tmp/cc --workloads w2"
rm -rf /tmp/cc
timeout 200 $B --engine-args $EA vision_thread=True --out $OUT/1_von.json 2>&1 | grep -v "$FILT" > $OUT/1_von.log
timeout 100 $B --engine-args $EA --out $OUT/2_voff.json 2>&1 | grep -v "$FILT" > $OUT/2_voff.log
timeout 120 $B --engine-args $EA vision_thread=True --out $OUT/3_von_trace.json --trace-dir /tmp/tr 2>&1 | grep -v "$FILT" > $OUT/3_von_trace.log
grep "engine ready\|w2 C=\|samples\|trace\|rror" $OUT/*.log | cut -c1-1500 | head -40
