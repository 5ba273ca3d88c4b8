# Session 17, call 6: prefill attention with three or four 64-row consumer warpgroups (a 740-token
# image prefill in 128 CTAs of 192 rows, one wave on 132 SMs, against the default 96 CTAs of 256),
# kernel alone at the prefill cases.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
timeout 400 python3 tools/bench_attention.py --tune --tune-prefill-only --budget-s 330 --out $OUT/6_prefill_tune.json 2>&1 \
  | grep -v "$FILT" > $OUT/6_prefill_tune.log
tail -40 $OUT/6_prefill_tune.log | cut -c1-200
