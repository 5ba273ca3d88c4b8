# Session 42, call 1 (H200): decode attention with 16-row tiles (`t16`: 8 channels of one key row
# per thread, built in the forty-first session and not yet timed), aiming at <= 64 registers so
# that B=32 at 128 tokens (1,024 CTAs) fits one wave at eight CTAs per SM. Kernel alone
# (`--tune`), each case twice, with ptxas's register/spill report per variant.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/1_env.txt
timeout 540 python3 tools/bench_attention.py --tune --ptxas-info --budget-s 420 --iters 60 --repeat 2 \
  --decode-cases 32x128,8x512,8x64,1x740,4x740,64x896 --variants "t16;t16,d8;t16,d4;t32,d4;t32" \
  --out $OUT/x/1_decode_tune.json > $OUT/x/1_decode_tune.log 2>&1
echo "tune rc $? ($SECONDS s)"
grep -v "$FILT" $OUT/x/1_decode_tune.log | grep "^decode\|Error\|skipped" | cut -c1-1500
grep "compiling\|registers\|spill" $OUT/x/1_decode_tune.log | uniq -c | cut -c1-200 | head -60
cd $OUT && tar czf 1_all.tgz x && rm -rf x
