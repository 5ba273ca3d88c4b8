# Session 14, call 7: two XLA settings against call 4's reproduction (a decode_buckets=1 engine that
# loses 607 -> 560 tok/s once the 2/4 and 8/16-row decode variants are loaded): the GPU executable
# run under an exclusive lock (cheaper command-buffer updates), and the whole 8-iteration decode loop
# as one command buffer (WHILE captured, loops unrolled).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
E='decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()'
for run in excl while; do
  case $run in
    excl) F="--xla_gpu_require_exclusive_lock=true";;
    while) F="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL --xla_gpu_command_buffer_unroll_loops=true";;
  esac
  XLA_FLAGS="$F" timeout 200 python3 tools/probe_loaded_modules.py --compile-cache /tmp/cc7_$run --xla --mosaic \
    --decode-buckets 2,4 8,16 --engine-args $E --out $OUT/7_$run.json 2>&1 | grep -v "$FILT" > $OUT/7_$run.log
done
grep -h "stage {\|stage failed\|ready\|Unknown flag" $OUT/7_*.log | cut -c18-400
