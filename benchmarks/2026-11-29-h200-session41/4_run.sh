# Session 41, call 4 (H200): issue 3's target table (`--targets`) with the new defaults (32-row
# decode tiles for large grids over short tables) and the new `layer` figure: the rotations share
# one page table and lengths, prepared once, as a step's 24 layers do (`layer_pools`), so its time
# per call is one layer's; "own prep" (the former call figure) prepares them per call.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/4_env.txt
timeout 450 python3 tools/bench_attention.py --targets --budget-s 60 --out $OUT/x/4_attention.json 2>&1 \
  | grep -v "$FILT" > $OUT/x/4_attention.log
echo "targets rc $? ($SECONDS s):"; grep "^decode\|^prefill\|^write" $OUT/x/4_attention.log | cut -c1-330
tail -14 $OUT/x/4_attention.log | cut -c1-260
cd $OUT && tar czf 4_all.tgz x && rm -rf x
