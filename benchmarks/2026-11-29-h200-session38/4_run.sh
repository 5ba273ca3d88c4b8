# Session 38, call 4 (H200, the session's last ~5 minutes): the fused fc1 + GELU kernel with a
# 2-CTA cluster along N, each A tile loaded half by each CTA and multicast to both (a third less
# L2 -> SMEM traffic per MMA; not interpretable on the CPU, so checked here against XLA).
# (1) bench_linear_gelu at MD2's 1536 / 1600 rows, 128x4 vs 128x4c2; (2) probe MD2 mixed + prefill
# steps, default vs KESTREL_JAX_LINEAR_GELU_CLUSTER=2.
# (Ran at commit 7c15a91; the cluster variant was removed after it, e73e4cc.)
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/4_env.txt
timeout 110 python3 tools/bench_linear_gelu.py --cases md2_prefill1536,md2_mixed,md2_prefill768 \
  --variants 128x4 128x4c2 64x4c2 --out $OUT/x/4_bench.json 2>&1 | grep -v "$FILT" > $OUT/x/4_bench.log
echo "bench ($SECONDS s):"; cut -c1-190 $OUT/x/4_bench.log | grep -v "^{" | head -20
timeout $((270 - SECONDS)) python3 tools/probe_step_kernels.py --kernels 30 --top 30 --model md2 --kinds mixed,prefill \
  --tokens 1536 --batch 64 --context 800 --wall-rounds 3 --sets default KESTREL_JAX_LINEAR_GELU_CLUSTER=2 \
  --json $OUT/x/4_probe.json 2>&1 | grep -v "$FILT" > $OUT/x/4_probe.log
echo "probe ($SECONDS s):"; grep "launches (\|rror\|linear_gelu" $OUT/x/4_probe.log | cut -c1-200 | head
cd $OUT && gzip x/4_probe*.json 2>/dev/null; tar czf 4_all.tgz x && rm -rf x
