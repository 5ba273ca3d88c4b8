# Session 26, call 3. Call 1: the sorted MoE GEMMs' units slice fastest took the W2 prefill step's
# grouped GEMMs 5,610 -> 4,733 us, but call 2's W2 pair showed no change (6,782 vs 6,826 tok/s, one
# pair). (1) the W2 mixed step (two 740-token prompts + 64 decode rows, 1536 bucket), the step W2
# actually runs 511 times: slices (default) vs blocks vs the two-consumer GEMM (KESTREL_JAX_MOE_WIDE=1,
# brought back from history, now in slice order); (2) MoE layer alone, FP8: the wide kernel in both
# orders at T 740 / 1480; (3) the order at T 256 and 2048 (64- and 128-token blocks).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/3_env.txt
timeout 260 python3 tools/probe_step_kernels.py --kernels 20 --top 12 --model md3 --kinds mixed \
  --tokens 1536 --prompt 740 --batch 64 --sets default KESTREL_JAX_MOE_SORTED_ORDER=blocks KESTREL_JAX_MOE_WIDE=1 \
  --wall-rounds 10 --json $OUT/x/3_probe.json 2>&1 | grep -v "$FILT" > $OUT/x/3_probe.log
echo "probe ($SECONDS s):"; grep -A3 "^\[" $OUT/x/3_probe.log | head -16; grep -i "error\|Traceback" $OUT/x/3_probe.log | head -5
timeout 170 python3 tools/bench_moe.py --precisions fp8 --no-baselines --tokens 740,1480 --wide-ab --rotate 2 \
  --budget-s 150 --out $OUT/x/3_moe_wide.json 2>&1 | grep -v "$FILT" > $OUT/x/3_moe_wide.log
echo "moe wide ($SECONDS s):"; grep -A8 "^    T mode" $OUT/x/3_moe_wide.log; grep -i "error\|FAILED\|Traceback" $OUT/x/3_moe_wide.log | head -5
timeout $((570 - SECONDS)) python3 tools/bench_moe.py --precisions fp8 --no-baselines --tokens 256,2048 --sorted-ab \
  --rotate 2 --budget-s $((540 - SECONDS)) --out $OUT/x/3_moe_order.json 2>&1 | grep -v "$FILT" > $OUT/x/3_moe_order.log
echo "moe order ($SECONDS s):"; grep -A10 "^    T mode" $OUT/x/3_moe_order.log; grep -i "error\|FAILED\|Traceback" $OUT/x/3_moe_order.log | head -5
cd $OUT && tar czf 3_all.tgz x && rm -rf x
