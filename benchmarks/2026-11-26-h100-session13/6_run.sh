# Session 13, call 6: every engine default (decode variants compiled alone, one-crop images encoded up
# to 4 at a time with a 30 ms wait), MD3, cold compile cache: start-up, W1, W2 C=64/32/8 (8 requests
# per client, as session 12's call 9); then the FP8 row-quantisation kernel against XLA's codes.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
timeout 480 python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc6 --workloads startup,w1,w2 \
  --concurrency 64 32 8 --requests-per-client 8 --out $OUT/6_md3.json 2>&1 | grep -v "$FILT" > $OUT/6_md3.log
timeout 90 python3 tools/check_quantize_kernel.py --out $OUT/6_quant.json 2>&1 | grep -v "$FILT" > $OUT/6_quant.log; echo "quant rc $?"
grep -h "engine ready\|w1:\|w2 C\|rror" $OUT/6_md3.log | sed 's/engine thread.*vision/ ... vision/' | cut -c18-300
cat $OUT/6_quant.log | cut -c1-250
