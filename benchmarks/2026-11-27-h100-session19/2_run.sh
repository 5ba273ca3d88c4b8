# Session 19, call 2: call 1's in-GEMM quantisation measured slower (the rows' TMA queued behind the
# weight ring; the down GEMM re-quantised for every unit). Now the rows load ahead of the ring, and
# the down GEMM takes contiguous unit ranges (output slice fastest), quantising each block once and
# prefetching the next block's rows. A/B per MoE layer at T = 1-32, then the forward check again.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
timeout 250 python3 tools/bench_moe.py --tokens 1,4,16,32 --precisions fp8 --no-routing-ab --no-baselines \
  --quant-ab --budget-s 220 --out $OUT/2_moe.json 2>&1 | grep -v "$FILT" > $OUT/2_moe.log
timeout 110 python3 tools/check_decode_fusion.py --switch KESTREL_JAX_MOE_GEMM_QUANT --batches 2 16 \
  --out $OUT/2_check.json 2>&1 | grep -v "$FILT" > $OUT/2_check.log
grep "^T=\|FAILED\|MISMATCH" $OUT/2_moe.log; tail -4 $OUT/2_check.log
for t in 1 4 16 32; do grep -A1 "^T= *$t fp8-w8a8" $OUT/2_moe.log | grep kernels | cut -c1-400; done
