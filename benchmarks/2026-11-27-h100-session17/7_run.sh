# Session 17, call 7: the issue-3 target table with this session's prefill schedule (three 64-row
# consumers at 740 tokens, four at 1024).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
timeout 420 python3 tools/bench_attention.py --targets --budget-s 360 --out $OUT/7_targets.json 2>&1 | grep -v "$FILT" > $OUT/7_targets.log
grep -A30 "== summary" $OUT/7_targets.log | cut -c1-160
