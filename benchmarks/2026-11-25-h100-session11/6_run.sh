# Session 11, call 6: the engine's default configuration end to end on MD3 (every default bucket:
# decode 1..64 (8), prefill 128..2048 (6, with 1536 new), vision 1,5,7,10,13): cold start-up with the
# threaded compile, then W1 and W2 C=64 and C=8.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
timeout 380 python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc --workloads startup,w1,w2 --concurrency 64 8 --requests-per-client 8 --out $OUT/6_md3_defaults.json 2>&1 | grep -v "$FILT" > $OUT/6_md3_defaults.log
grep -h "engine ready\|w1:\|w2 C=\|rror" $OUT/6_md3_defaults.log | cut -c1-900
