# Session 18, call 3: check_decode_fusion now clears every JAX cache between on and off (before, a
# switch read inside a kernel's jitted entry point kept the first trace, so MoE switches compared a
# path with itself). The fused UP + DOWN launch and the MoE PDL switch re-checked on a full-size
# forward; then the dense regime's W8A16 / W8A8 split at T = 2, 3 (the threshold is 4).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
timeout 200 python3 tools/check_decode_fusion.py --switch KESTREL_JAX_MOE_FUSED KESTREL_JAX_MOE_PDL KESTREL_JAX_GEMV_ROWS \
  --batches 1 4 --out $OUT/3_check.json 2>&1 | grep -v "$FILT" > $OUT/3_check.log
timeout 150 python3 tools/bench_moe.py --tokens 2,3 --precisions fp8 --no-routing-ab --no-baselines \
  --out $OUT/3_moe.json 2>&1 | grep -v "$FILT" > $OUT/3_moe.log
cat $OUT/3_check.log | tail -8; grep "^T=" $OUT/3_moe.log
