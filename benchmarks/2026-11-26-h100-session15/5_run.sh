# Session 15, call 5: does compiling the 8- and 16-row decode variants (XLA autotunes on the GPU
# while compiling) bring the batch-1 slow state, or running them? (a) decode_buckets=1 engine;
# variants 2,4 loaded and run; 8,16 compiled only; then run. (b) the call-4 stages of session 14
# (2,4 then 8,16 loaded and run) with XLA's autotuning off in the whole process.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
timeout 230 python3 tools/probe_loaded_modules.py --compile-cache /tmp/cc5 --decode-buckets 2,4 --decode-buckets-compile 8,16 \
  --xla --mosaic --engine-args $EA --out $OUT/5_probe_compile.json 2>&1 | grep -v "$FILT" > $OUT/5_probe_compile.log
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 250 python3 tools/probe_loaded_modules.py --compile-cache /tmp/cc5b \
  --decode-buckets 2,4 8,16 --xla --mosaic --engine-args $EA --out $OUT/5_probe_noautotune.json 2>&1 | grep -v "$FILT" > $OUT/5_probe_noautotune.log
grep -h "stage {\|rror\|ready" $OUT/5_probe_*.log | cut -c18-260
