# Planned for the next GPU session (one call, up to 10 min): the engine's defaults end to end on MD3
# (every default bucket; call 6 ran out of device time after 225 s of cold start-up): cold and warm
# start-up with the threaded compile, equal num_pages in both processes, W1 and W2 C=64/32/8.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
timeout 440 python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc --workloads startup,w1,w2 --concurrency 64 32 8 --requests-per-client 8 --out $OUT/1_md3.json 2>&1 | grep -v "$FILT" > $OUT/1_md3.log
timeout 100 python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc --workloads startup --out $OUT/1_md3_warm.json 2>&1 | grep -v "$FILT" > $OUT/1_md3_warm.log
grep -h "engine ready\|num_pages\|w1:\|w2 C=\|rror" $OUT/1_*.log | cut -c1-600
