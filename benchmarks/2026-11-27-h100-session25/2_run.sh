# Session 25, call 2: the sorted MoE regime's GEMMs with two consumer warpgroups sharing each token
# tile (`_grouped_gemm_wide`, KESTREL_JAX_MOE_WIDE). Call 1 found the one-warpgroup kernel bound by
# its L2 -> SMEM traffic (Nt 64 vs 128: same 5.6 ms per W2 prefill step with ~25% fewer FLOPs).
# (1) the MoE layer alone, FP8, T = 740 and 1480, narrow vs wide (outputs checked against the
# reference); (2) the W2 prefill step (two 740-token prompts, 1536 bucket) with KESTREL_JAX_MOE_WIDE=0,1.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/2_env.txt
timeout 300 python3 tools/bench_moe.py --precisions fp8 --no-baselines --tokens 740,1480 --wide-ab --rotate 2 \
  --budget-s 240 --out $OUT/x/2_moe.json 2>&1 | grep -v "$FILT" > $OUT/x/2_moe.log
echo "moe ($SECONDS s):"; grep -A8 "^    T mode" $OUT/x/2_moe.log; grep -i "error\|FAILED\|Traceback" $OUT/x/2_moe.log | head -5
timeout $((570 - SECONDS)) python3 tools/probe_step_kernels.py --kernels 30 --top 20 --model md3 --kinds prefill \
  --tokens 1536 --prompt 740 --ab KESTREL_JAX_MOE_WIDE=0,1 --json $OUT/x/2_probe_wide.json 2>&1 \
  | grep -v "$FILT" > $OUT/x/2_probe_wide.log
echo "probe wide ($SECONDS s):"; grep -A6 "^\[" $OUT/x/2_probe_wide.log | head -30; grep -i "error\|Traceback" $OUT/x/2_probe_wide.log | head -5
cd $OUT && tar czf 2_all.tgz x && rm -rf x
