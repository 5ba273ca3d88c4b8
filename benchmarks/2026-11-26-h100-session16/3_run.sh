# Session 16, call 3: call 2 found the batch-1 slow state reversible: running the 6- and 12-row
# variants brought it, running the 24-row ones after them took it away again. Is it the device
# allocator's placement? (a) the same run sequence with XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async
# (stream-ordered cudaMallocAsync pool instead of the BFC arena; KV pool fixed at 1024 pages);
# (b) the default allocator again, the same sequence: is the pattern reproducible?
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async timeout 230 python3 tools/probe_loaded_modules.py --compile-cache /tmp/cc4 --decode-buckets 2,4 6,12 24 8,16 \
  --xla --mosaic --engine-args $EA runner.num_pages=1024 --out $OUT/3_probe_async.json 2>&1 | grep -v "$FILT" > $OUT/3_probe_async.log
grep -h "stage {\|rror\|ready" $OUT/3_probe_async.log | cut -c18-200
timeout 230 python3 tools/probe_loaded_modules.py --compile-cache /tmp/cc5 --decode-buckets 2,4 6,12 24 8,16 \
  --xla --mosaic --engine-args $EA --out $OUT/3_probe_bfc.json 2>&1 | grep -v "$FILT" > $OUT/3_probe_bfc.log
grep -h "stage {\|rror\|ready" $OUT/3_probe_bfc.log | cut -c18-200
