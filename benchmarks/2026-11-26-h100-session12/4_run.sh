# Session 12, call 4 (session 11 7c_planned_defaults.sh) with the two prefill switches that calls 1-3 measured faster exported (they become the defaults)
export KESTREL_JAX_TAU_GELU=poly KESTREL_JAX_SPLIT_DENSE_GEMMS=1
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
timeout 440 python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc --workloads startup,w1,w2 --concurrency 64 32 8 --requests-per-client 8 --out $OUT/4_md3.json 2>&1 | grep -v "$FILT" > $OUT/4_md3.log
timeout 100 python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc --workloads startup --out $OUT/4_md3_warm.json 2>&1 | grep -v "$FILT" > $OUT/4_md3_warm.log
grep -h "engine ready\|num_pages\|w1:\|w2 C=\|rror" $OUT/4_*.log | cut -c1-600
