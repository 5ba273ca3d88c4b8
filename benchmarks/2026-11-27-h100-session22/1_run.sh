# Session 22, call 1: GPU checks of session 21's untested work, then two step A/Bs (CUPTI + wall):
# region heads on the decode GEMM kernel vs XLA (argmax agreement); QKV + router through gemv_rows at
# 64 rows (KESTREL_JAX_GEMV_QKV_ROWS=64) and the dense-projection gemv (KESTREL_JAX_DENSE_PROJ_GEMV=1)
# against their defaults (final hidden states); the 64-row decode step A/B; the batch-1 step A/B.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/1_env.txt
timeout 100 python3 tools/check_region_heads.py --model md3 --rows 1 8 --out $OUT/x/1_region.json 2>&1 \
  | grep -v "$FILT" > $OUT/x/1_region.log
tail -12 $OUT/x/1_region.log
timeout 120 python3 tools/check_decode_fusion.py --switch KESTREL_JAX_GEMV_QKV_ROWS=64,1 --batches 64 8 \
  --out $OUT/x/1_fusion_qkv.json 2>&1 | grep -v "$FILT" > $OUT/x/1_fusion_qkv.log
tail -6 $OUT/x/1_fusion_qkv.log
timeout 90 python3 tools/check_decode_fusion.py --switch KESTREL_JAX_DENSE_PROJ_GEMV --batches 1 3 \
  --out $OUT/x/1_fusion_dp.json 2>&1 | grep -v "$FILT" > $OUT/x/1_fusion_dp.log
tail -6 $OUT/x/1_fusion_dp.log
timeout 150 python3 tools/probe_step_kernels.py --kernels 30 --model md3 --kinds decode --batch 64 \
  --ab KESTREL_JAX_GEMV_QKV_ROWS=1,64 --json $OUT/x/1_probe64.json 2>&1 | grep -v "$FILT" > $OUT/x/1_probe64.log
grep -A22 "^decode:" $OUT/x/1_probe64.log | tail -23
timeout 140 python3 tools/probe_step_kernels.py --kernels 30 --model md3 --kinds decode --batch 1 \
  --ab KESTREL_JAX_DENSE_PROJ_GEMV=0,1 --json $OUT/x/1_probe1.json 2>&1 | grep -v "$FILT" > $OUT/x/1_probe1.log
grep -A22 "^decode:" $OUT/x/1_probe1.log | tail -23
cd $OUT && tar czf 1_all.tgz x && rm -rf x
