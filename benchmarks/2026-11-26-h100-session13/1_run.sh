# Session 13, call 1: why batch-1 decode (W1) is 8% slower with the default decode bucket set than
# with decode_buckets=1. Each engine starts with its own cold compile cache, dumps XLA's autotuning
# results (which GEMM configs it picked) and profiles 0.5 s of pure batch-1 decode (kernel families
# per decode iteration in the JSON). Same kernels at different times = the configs picked differ.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
for cfg in one defaults; do
  EA=""; T=300; [ $cfg = one ] && EA="--engine-args decode_buckets=1" && T=200
  XLA_FLAGS=--xla_gpu_dump_autotune_results_to=/tmp/at_$cfg.txt timeout $T python3 tools/benchmark.py --model md3 \
    --random-weights --compile-cache /tmp/cc_$cfg --workloads w1 $EA --trace-dir /tmp/tr_$cfg \
    --out $OUT/1_w1_$cfg.json 2>&1 | grep -v "$FILT" > $OUT/1_w1_$cfg.log
done
tar czf $OUT/1_autotune.tar.gz -C /tmp at_one.txt at_defaults.txt
grep -h "engine ready\|w1:\|rror" $OUT/1_w1_*.log | cut -c1-300
