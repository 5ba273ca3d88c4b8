# Session 19, call 1: dense W8A8 with the token rows and the activation quantised inside the GEMMs
# (KESTREL_JAX_MOE_GEMM_QUANT=1, new default) vs the two quantisation launches, per MoE layer at
# T = 1-32; then a full-size forward with the switch on vs off (batches 2, 8, and 1 with W8A8 forced).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > $OUT/1_env.txt
timeout 330 python3 tools/bench_moe.py --tokens 1,4,8,16,32 --precisions fp8 --no-routing-ab --no-baselines \
  --quant-ab --budget-s 280 --out $OUT/1_moe.json 2>&1 | grep -v "$FILT" > $OUT/1_moe.log
timeout 110 python3 tools/check_decode_fusion.py --switch KESTREL_JAX_MOE_GEMM_QUANT --batches 2 8 \
  --out $OUT/1_check.json 2>&1 | grep -v "$FILT" > $OUT/1_check.log
KESTREL_JAX_W8A8_MIN_TOKENS=1 timeout 80 python3 tools/check_decode_fusion.py --switch KESTREL_JAX_MOE_GEMM_QUANT \
  --batches 1 --out $OUT/1_check1.json 2>&1 | grep -v "$FILT" > $OUT/1_check1.log
grep "^T=\|FAILED\|MISMATCH" $OUT/1_moe.log; tail -4 $OUT/1_check.log; tail -3 $OUT/1_check1.log
