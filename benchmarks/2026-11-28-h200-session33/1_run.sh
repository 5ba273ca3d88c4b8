# Session 33, call 1 (H200): (1) MD3 batch-1 decode step with the two opt-in fusions measured
# slower on an H100 (session 24: merged projection; session 20: residual + LayerNorm), A/B on the
# H200 in one process (probe --sets, CUPTI and wall); (2) where MD2's W2 steps go, kernel by kernel
# with their HLO: decode at 64 rows (context 800), the 1536-token prefill and mixed steps.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x/hlo
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/1_env.txt
timeout 330 python3 tools/probe_step_kernels.py --kernels 12 --top 30 --model md3 --kinds decode --batch 1 --steps 1 \
  --wall-rounds 10 --sets default KESTREL_JAX_MERGED_PROJ=1 KESTREL_JAX_RESIDUAL_LN=1 \
  KESTREL_JAX_MERGED_PROJ=1+KESTREL_JAX_RESIDUAL_LN=1 --json $OUT/x/1_1_md3_b1.json 2>&1 | grep -v "$FILT" > $OUT/x/1_1_md3_b1.log
echo "md3 ($SECONDS s): $(grep "launches (" $OUT/x/1_1_md3_b1.log | cut -c1-200)"
timeout $((585 - SECONDS)) python3 tools/probe_step_kernels.py --kernels 60 --top 60 --model md2 --kinds decode,mixed,prefill \
  --batch 64 --context 800 --tokens 1536 --prompt 740 --wall-rounds 5 --out-dir $OUT/x/hlo 2>&1 | grep -v "$FILT" > $OUT/x/1_2_md2.log
echo "md2 ($SECONDS s): $(grep "launches (" $OUT/x/1_2_md2.log | cut -c1-200)"
cd $OUT && tar czf 1_all.tgz x && rm -rf x
