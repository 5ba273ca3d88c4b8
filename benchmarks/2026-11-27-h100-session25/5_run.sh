# Session 25, call 5: `_grouped_gemm_wide` rebuilt after call 4's Nsight Compute profile (DRAM at
# 68-72% of peak, ~2x the experts' bytes, tensor pipe 42-48%): two consumer warpgroups now share
# each weight tile, one block of a same-expert block pair each. (1) MoE layer alone, FP8, T = 740
# and 1480, narrow vs wide (checked against the reference); (2) the W2 prefill step (two 740-token
# prompts, 1536 bucket): default, wide, wide with 64-token blocks.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/5_env.txt
timeout 200 python3 tools/bench_moe.py --precisions fp8 --no-baselines --tokens 740,1480 --wide-ab --rotate 2 \
  --budget-s 170 --out $OUT/x/5_moe.json 2>&1 | grep -v "$FILT" > $OUT/x/5_moe.log
echo "moe ($SECONDS s):"; grep -A8 "^    T mode" $OUT/x/5_moe.log; grep -i "error\|FAILED\|Traceback" $OUT/x/5_moe.log | head -5
timeout $((540 - SECONDS)) python3 tools/probe_step_kernels.py --kernels 20 --top 12 --model md3 --kinds prefill \
  --tokens 1536 --prompt 740 --sets default KESTREL_JAX_MOE_WIDE=1 KESTREL_JAX_MOE_WIDE=1+KESTREL_JAX_MOE_SORTED_NT=64 \
  --wall-rounds 10 --json $OUT/x/5_probe_wide.json 2>&1 | grep -v "$FILT" > $OUT/x/5_probe_wide.log
echo "probe wide ($SECONDS s):"; grep -A3 "^\[" $OUT/x/5_probe_wide.log | head -20; grep -i "error\|Traceback" $OUT/x/5_probe_wide.log | head -5
cd $OUT && tar czf 5_all.tgz x && rm -rf x
