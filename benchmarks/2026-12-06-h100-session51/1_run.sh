# Session 51, call 1: decode-size GEMMs with FP8 (e4m3, per-output-column scale) weights through
# XLA (the convert fused into its GEMM: W8A16; or rows quantised per row: W8A8) beside the bf16
# paths the engine uses (XLA's GEMM, the Mosaic kernels), at 1, 8 and 64 rows, 24 cold weights.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/1_env.txt
timeout 560 python3 tools/bench_decode_gemm.py --rows 1 8 64 --budget-s 480 \
  --shapes qkv_router,proj,dense_qkv_fc1,dense_fc2,lm_head \
  --variants default,gemv,gemv_rows,xla_w8a16,xla_w8a8 --out $OUT/1_decode_gemm.json 2>&1 \
  | grep -v "$FILT" > $OUT/1_decode_gemm.log
grep -v "^ \|Traceback\|^  File" $OUT/1_decode_gemm.log | cut -c1-160
