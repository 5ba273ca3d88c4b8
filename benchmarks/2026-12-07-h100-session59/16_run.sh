# Session 59 call 3: the batch-1 decode step's optimized HLO as the engine compiles it (KV pool donated),
# MD3 and MD2, 1 and 8 iterations per launch, to find the copies CUPTI shows as `memcpy32_post`.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc\|^W1\|^I1'
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/16_env.txt
for M in md3 md2; do
  timeout 280 python3 benchmarks/2026-12-07-h100-session59/16_hlo.py $OUT/hlo $M --steps 1,8 2>&1 | grep -v "$FILT" > $OUT/16_$M.log
  echo "$M ($SECONDS s): $(grep 'copy ops\|rror' $OUT/16_$M.log | tr '\n' ' ')"
done
