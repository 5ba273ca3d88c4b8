# Session 15, call 6: call 5 found that compiling the 8- and 16-row decode variants (not running
# them) brings the batch-1 slow state. Is it tied to executables loaded before that compile? After
# the slow state, the engine's own 1-row decode steps are loaded again as new executables (export
# and compile caches; the old ones kept alive) and W1 measured through them.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
timeout 280 python3 tools/probe_loaded_modules.py --compile-cache /tmp/cc6 --decode-buckets 2,4 --decode-buckets-compile 8,16 \
  --reload-base --xla --mosaic --engine-args $EA --out $OUT/6_probe_reload.json 2>&1 | grep -v "$FILT" > $OUT/6_probe_reload.log
grep -h "stage {\|rror\|ready\|reloaded" $OUT/6_probe_reload.log | cut -c18-260; grep reloaded $OUT/6_probe_reload.json
