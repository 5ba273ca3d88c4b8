# Session 42, call 2 (H200): `decode_tile_plan` now takes 16-row tiles in an eight-slot ring for
# large grids over short tables (call 1: B=32 at 128 tokens 9.9 us against 11.8). Here the rule's
# edges, kernel alone: grids of 256-4,096 CTAs over 64-256 keys, the default against the previous
# plan (`t32,d4`), 64-row tiles (`t64`) and 16-row tiles forced (`t16,d8`, for the grids under
# the rule's two CTAs per SM); then issue 3's target table (`--targets`) with the new default.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/2_env.txt
timeout 260 python3 tools/bench_attention.py --tune --budget-s 220 --iters 60 \
  --decode-cases 8x64,8x128,8x256,16x128,16x256,32x128,32x256,64x128,64x256,128x128,128x256 \
  --variants "t16,d8;t32,d4;t64" --out $OUT/x/2_decode_tune.json > $OUT/x/2_decode_tune.log 2>&1
echo "tune rc $? ($SECONDS s)"
grep -v "$FILT" $OUT/x/2_decode_tune.log | grep "^decode\|Error\|skipped" | cut -c1-700
timeout $((585 - SECONDS)) python3 tools/bench_attention.py --targets --budget-s 200 --out $OUT/x/2_attention.json 2>&1 \
  | grep -v "$FILT" > $OUT/x/2_attention.log
echo "targets ($SECONDS s):"; grep "^decode\|^prefill\|^write" $OUT/x/2_attention.log | cut -c1-330
tail -14 $OUT/x/2_attention.log | cut -c1-260
cd $OUT && tar czf 2_all.tgz x && rm -rf x
