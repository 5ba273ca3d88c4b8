# Session 22, call 6: L2 prefetch by the MoE GEMMs at the end of each CTA, on top of the default 14
# (attention: the experts' up rows): +16 the up GEMM asks for the selected experts' down weights,
# +32 the down GEMM for the next MoE layer's QKV and router weights. Batch-1 step A/B (CUPTI + wall).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
timeout 250 python3 tools/probe_step_kernels.py --kernels 30 --model md3 --kinds decode --batch 1 \
  --ab KESTREL_JAX_L2_PREFETCH=14,30,46,62 --json $OUT/x/6_probe1.json 2>&1 | grep -v "$FILT" > $OUT/x/6_probe1.log
grep "^\[" $OUT/x/6_probe1.log
grep -A8 "^decode:" $OUT/x/6_probe1.log | head -40
cd $OUT && tar czf 6_all.tgz x && rm -rf x
