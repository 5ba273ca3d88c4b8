# Planned for the next GPU session (one call, ~6-7 min): why batch-1 decode (W1) is 8% slower with
# the default decode bucket set (556-561 tok/s, calls 4, 9, 10) than with decode_buckets=1 (608,
# call 7). A trace of 0.5 s of pure batch-1 decode from each engine (each with its own, cold compile
# cache: the hypothesis is that XLA's GEMM autotuning, run while 8 threads compile 57 programs on one
# GPU, picks worse configs for the batch-1 programs); the summaries list kernel families per
# decode iteration: compare them (same kernels, different times = autotuning / placement; different
# kernels = the programs differ).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
for cfg in one defaults; do
  EA=""; [ $cfg = one ] && EA="--engine-args decode_buckets=1"
  timeout 270 python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc_$cfg --workloads w1 $EA \
    --trace-dir /tmp/tr_$cfg --out $OUT/11_w1_$cfg.json 2>&1 | grep -v "$FILT" > $OUT/11_w1_$cfg.log
done
grep -h "engine ready\|w1:\|rror" $OUT/11_w1_*.log | cut -c1-300
