# Session 15, call 1. (a) The FP8 row-quantisation kernel against XLA after both compute values times
# the reciprocal of the scale (the CPU tie fix). (b) Is the batch-1 slow state a count of CUDA graph
# nodes in the process? A decode_buckets=1 engine, then 8 / 24 / 48 extra command-buffer programs of
# 60 GEMMs + 60 fusions each (~960 / 2,880 / 5,760 graph nodes; the 2,4,8,16 decode variants that
# trigger the slow state hold a few thousand), then those released. (c) The decode variants 2,4
# loaded as usual, then 8,16 and 32,48,64 compiled with XLA command buffers off.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
timeout 100 python3 tools/check_quantize_kernel.py --out $OUT/1_quant.json 2>&1 | grep -v "$FILT" | tail -5 > $OUT/1_quant.log
timeout 250 python3 tools/probe_loaded_modules.py --compile-cache /tmp/cc1 --graph 8 24 48 --graph-depth 60 --xla --mosaic \
  --engine-args $EA --out $OUT/1_probe_graph.json 2>&1 | grep -v "$FILT" > $OUT/1_probe_graph.log
timeout 230 python3 tools/probe_loaded_modules.py --compile-cache /tmp/cc1 --decode-buckets 2,4 --decode-buckets-nocb 8,16 32,48,64 \
  --xla --mosaic --engine-args $EA --out $OUT/1_probe_nocb.json 2>&1 | grep -v "$FILT" > $OUT/1_probe_nocb.log
cat $OUT/1_quant.log; grep -h "stage\|rror\|ready" $OUT/1_probe_*.log | cut -c18-300
