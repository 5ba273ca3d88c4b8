# Session 18, call 5 (call 4 found no nsys on the machine): issue 4's FP8 targets re-measured with
# the current defaults (T = 740 last measured in session 11).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
timeout 300 python3 tools/bench_moe.py --tokens 1,4,16,740 --precisions fp8 --no-routing-ab --no-baselines \
  --out $OUT/5_moe.json 2>&1 | grep -v "$FILT" > $OUT/5_moe.log
grep "^T=\|ceilings" $OUT/5_moe.log
