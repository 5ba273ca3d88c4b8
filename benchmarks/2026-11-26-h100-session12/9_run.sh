# Session 12, call 9: every default of this session's end (commit after the tau-factor default), MD3, as call 4:
# cold and warm start-up with the full default bucket set, W1, W2 C=64/32/8.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
timeout 440 python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc --workloads startup,w1,w2 --concurrency 64 32 8 --requests-per-client 8 --out $OUT/9_md3.json 2>&1 | grep -v "$FILT" > $OUT/9_md3.log
timeout 100 python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc --workloads startup --out $OUT/9_md3_warm.json 2>&1 | grep -v "$FILT" > $OUT/9_md3_warm.log
grep -h "engine ready\|num_pages\|w1:\|w2 C=\|rror" $OUT/9_*.log | cut -c1-600
