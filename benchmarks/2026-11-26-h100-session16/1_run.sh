# Session 16, call 1: the batch-1 slow state (compiling the 8- and 16-row decode variants into a
# decode_buckets=1 engine slows its W1 ~8%, session 15). (a) the same compile-only trigger with
# CUDA_MODULE_LOADING=EAGER (every kernel of every module loaded at once); (b) other small bucket
# sizes compiled cumulatively (2,4 / 6,12 / 24 / 8 / 16): which set triggers it, and is there a
# default set with fine granularity that does not?
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $OUT/1_smi.txt
CUDA_MODULE_LOADING=EAGER timeout 200 python3 tools/probe_loaded_modules.py --compile-cache /tmp/cc1 --decode-buckets-compile 2,4 8,16 \
  --xla --mosaic --engine-args $EA --out $OUT/1_probe_eager.json 2>&1 | grep -v "$FILT" > $OUT/1_probe_eager.log
grep -h "stage {\|rror\|ready" $OUT/1_probe_eager.log | cut -c18-230
timeout 330 python3 tools/probe_loaded_modules.py --compile-cache /tmp/cc2 --decode-buckets-compile 2,4 6,12 24 8 16 \
  --xla --mosaic --engine-args $EA --out $OUT/1_probe_sizes.json 2>&1 | grep -v "$FILT" > $OUT/1_probe_sizes.log
grep -h "stage {\|rror\|ready" $OUT/1_probe_sizes.log | cut -c18-230
