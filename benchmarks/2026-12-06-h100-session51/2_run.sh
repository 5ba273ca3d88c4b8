# Session 51, call 2: FP8 decode GEMMs through the MoE's Mosaic grouped GEMM (one expert, one block
# of rows; W8A8 with in-kernel row quantisation, or W8A16), beside the bf16 kernels, 24 cold weights.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/2_env.txt
timeout 500 python3 tools/bench_decode_gemm.py --rows 1 8 64 --budget-s 420 \
  --shapes qkv_router,proj,dense_qkv_fc1,dense_fc2,lm_head \
  --variants gemv_rows,gemv,default,mgpu_w8a8,mgpu_w8a16 --out $OUT/2_decode_gemm.json 2>&1 \
  | grep -v "$FILT" > $OUT/2_decode_gemm.log
grep -v "^ \|Traceback\|^  File" $OUT/2_decode_gemm.log | cut -c1-160
