# Prepared in session 51 (2026-12-06): the FP8 decode GEMM cases session 51's call 2 did not reach
# (its budget went to compiling 24 kernel instances per case): the dense layers' joined products,
# fc2 and the LM head, FP8 W8A8 through the MoE's Mosaic grouped GEMM (one expert) against the bf16
# paths, 16 cold weights per case (FP8 weights of the output projection stay past the 50 MB L2 at
# 16). Move this file into the session's dated folder before running it (any H100 or H200).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/2_env.txt
timeout 500 python3 tools/bench_decode_gemm.py --rows 1 8 --layers 16 --budget-s 440 \
  --shapes dense_qkv_fc1,dense_fc2,lm_head,proj --variants gemv_rows,default,mgpu_w8a8 \
  --out $OUT/2_decode_gemm.json 2>&1 | grep -v "$FILT" > $OUT/2_decode_gemm.log
grep -v "^ \|Traceback\|^  File" $OUT/2_decode_gemm.log | cut -c1-160
