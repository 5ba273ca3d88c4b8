# Session 15, call 3: decode attention with several KV heads per CTA through one TMA ring that runs
# on from head to head (heads_per_cta, new) against the default one head per CTA, kernel-only
# times at the issue-3 cases (bench_attention.py --tune).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
timeout 420 python3 tools/bench_attention.py --tune --budget-s 300 --out $OUT/3_tune.json 2>&1 | grep -v "$FILT" > $OUT/3_tune.log
grep "^decode\|summary\|SLOWER\|FASTER\|FAILED" $OUT/3_tune.log | cut -c1-600
