# Session 16, call 2: call 1 found that compiling 2,4,6,12,24-row decode variants leaves batch-1
# decode fast and adding the 8-row one slows it; with CUDA_MODULE_LOADING=EAGER compiling 8,16 did
# not, running them did. Here the candidate bucket set is RUN (each variant executed), cumulatively:
# 2,4 / 6,12 / 24 / 32,48,64, then 8 as the positive control.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
timeout 420 python3 tools/probe_loaded_modules.py --compile-cache /tmp/cc3 --decode-buckets 2,4 6,12 24 32,48,64 8 \
  --xla --mosaic --engine-args $EA --out $OUT/2_probe_run.json 2>&1 | grep -v "$FILT" > $OUT/2_probe_run.log
grep -h "stage {\|rror\|ready" $OUT/2_probe_run.log | cut -c18-230
