# Session 41, call 3 (H200): call 1 had 32-row tiles with a four-slot ring (`t32,d4`) at 11.8 us
# for B=32 at 128 tokens against 12.1 for the defaults (64-row tiles, four slots) and 12.3 for
# 32-row tiles at the default eight slots. Is it the registers or the SMEM per CTA? Here the
# decode variants plus fewer slots at either tile size (`d2`, `t32,d2`), at the target cases and
# the engine's W2 decode shape (64 rows at ~900 tokens), each case twice (`--repeat 2`).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/3_env.txt
timeout 450 python3 tools/bench_attention.py --tune --budget-s 380 --iters 60 --repeat 2 \
  --decode-cases 32x128,8x512,4x740,1x740,64x896,64x2048 \
  --out $OUT/x/3_decode_tune.json > $OUT/x/3_decode_tune.log 2>&1
echo "tune rc $? ($SECONDS s)"
grep -v "$FILT" $OUT/x/3_decode_tune.log | grep "^decode\|Error\|skipped" | cut -c1-1500
cd $OUT && tar czf 3_all.tgz x && rm -rf x
