# Session 22, call 5: the QKV + router through gemv_rows (KESTREL_JAX_GEMV_QKV_ROWS=64) at the decode
# buckets between 1 and 64: step A/B (CUPTI + wall) at batch 8 and 32.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
for b in 8 32; do
  timeout 150 python3 tools/probe_step_kernels.py --kernels 30 --model md3 --kinds decode --batch $b \
    --ab KESTREL_JAX_GEMV_QKV_ROWS=1,64 --json $OUT/x/5_probe$b.json 2>&1 | grep -v "$FILT" > $OUT/x/5_probe$b.log
  echo "batch $b:"; grep -A8 "^decode:" $OUT/x/5_probe$b.log | head -10
done
cd $OUT && tar czf 5_all.tgz x && rm -rf x
