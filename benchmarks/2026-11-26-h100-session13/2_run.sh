# Session 13, call 2: the engine's defaults with the decode variants compiled first, one at a time
# (EngineConfig.decode_alone, new), from a cold compile cache: start-up, W1, then W2 C=64 (8 requests
# per client, as session 12's call 9: 6,277 tok/s; call 1 today: W1 560.8 tok/s with 8 threads).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
XLA_FLAGS=--xla_gpu_dump_autotune_results_to=/tmp/at_alone.txt timeout 570 python3 tools/benchmark.py --model md3 \
  --random-weights --compile-cache /tmp/cc --workloads startup,w1,w2 --concurrency 64 --requests-per-client 8 \
  --out $OUT/2_md3.json 2>&1 | grep -v "$FILT" > $OUT/2_md3.log
gzip -c /tmp/at_alone.txt > $OUT/2_autotune_alone.txt.gz
grep -h "engine ready\|w1:\|w2\|rror" $OUT/2_md3.log | cut -c1-400
