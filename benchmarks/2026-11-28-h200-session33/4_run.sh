# Session 33, call 4 (H200): issue 4's full table on the H200: the MoE layer at T in {1, 4, 8, 16,
# 32, 64, 256, 740, 2048}, FP8 and bf16, with XLA ragged_dot and ragged_dot_mgpu beside it in the
# same run (call 2 ran the target cases without them).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/4_env.txt
timeout 565 python3 tools/bench_moe.py --no-routing-ab --budget-s 430 --out $OUT/x/4_moe.json 2>&1 \
  | grep -v "$FILT" > $OUT/x/4_moe.log
echo "moe ($SECONDS s):"; grep -A22 "^    T mode" $OUT/x/4_moe.log | head -24; grep -i "Traceback\|FAILED\|skipping" $OUT/x/4_moe.log | cut -c1-150 | head -8
cd $OUT && tar czf 4_all.tgz x && rm -rf x
