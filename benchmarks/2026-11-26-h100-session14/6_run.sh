# Session 14, call 6: loading the decode step's 2/4 and 8/16-row variants slows batch-1 decode
# 607 -> 560 tok/s (call 4); call 5 saw a launch failure reported by XLA's command-buffer tracing
# ("Failed to check stream capturing status") in the same setting. Hypothesis: buffer addresses
# change from launch to launch, and the command buffers are updated or re-traced (the trace cache
# holds 16 address sets per captured custom call). Same probe under three XLA settings.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
E='decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()'
for run in cache256 varemap nocustom; do
  case $run in
    cache256) F="--xla_cmd_buffer_trace_cache_size=256";;
    varemap) F="--xla_gpu_enable_command_buffer_va_remapping=true";;
    nocustom) F="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUDNN,DYNAMIC_SLICE_FUSION";;
  esac
  XLA_FLAGS="$F" timeout 190 python3 tools/probe_loaded_modules.py --compile-cache /tmp/cc6_$run --xla --mosaic \
    --decode-buckets 2,4 8,16 --engine-args $E --out $OUT/6_$run.json 2>&1 | grep -v "$FILT" > $OUT/6_$run.log
done
grep -h "stage {\|stage failed\|ready" $OUT/6_*.log | cut -c18-400
