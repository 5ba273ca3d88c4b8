# Session 14, call 3: does batch-1 decode slow down with the number of GPU programs loaded? One
# decode_buckets=1 engine; W1 (2 x 3 x 512 tokens) after loading 64 extra XLA programs, then 24 / 48 /
# 96 / 192 extra Mosaic GPU kernels (each its own GPU module). Then the same with eager CUDA module
# loading (CUDA_MODULE_LOADING=EAGER).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
timeout 280 python3 tools/probe_loaded_modules.py --compile-cache /tmp/cc3 --xla 64 --mosaic 24 48 96 192 \
  --out $OUT/3_probe.json 2>&1 | grep -v "$FILT" > $OUT/3_probe.log
CUDA_MODULE_LOADING=EAGER timeout 250 python3 tools/probe_loaded_modules.py --compile-cache /tmp/cc3 --xla --mosaic 96 192 \
  --out $OUT/3_probe_eager.json 2>&1 | grep -v "$FILT" > $OUT/3_probe_eager.log
grep -h "stage\|rror\|ready" $OUT/3_probe*.log | cut -c18-400
