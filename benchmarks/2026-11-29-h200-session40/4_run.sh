# Session 40, call 4 (H200): prefill attention, kernel alone (`--tune-prefill-only --variants`):
# the defaults (now with setmaxnreg (104, 64) for four 64-row consumers) against the even register
# share, a third TMA staging slot and 64-key tiles; twice each, to see the run-to-run spread.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/4_env.txt
for i in 1 2; do
  timeout $((560 - SECONDS)) python3 tools/bench_attention.py --tune --tune-prefill-only --budget-s 200 \
    --variants "4wg,R64,r96/96;3wg,R64,bk128,st3;4wg,R64,st3;3wg,R64;noskip" --iters 40 \
    --out $OUT/x/4_${i}_prefill_tune.json > $OUT/x/4_${i}_prefill_tune.log 2>&1
  echo "tune $i rc $? ($SECONDS s)"
  grep -v "$FILT" $OUT/x/4_${i}_prefill_tune.log | grep "^prefill\|Error" | cut -c1-1500
done
cd $OUT && tar czf 4_all.tgz x && rm -rf x
