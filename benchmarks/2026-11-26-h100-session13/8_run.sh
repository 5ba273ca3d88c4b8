# Session 13, call 8: is batch-1 decode host-bound on this machine, and do XLA command buffers help?
# W1 with a trace of 0.5 s of pure batch-1 decode (device busy fraction), default XLA flags vs command
# buffers for fusions, cuBLAS, custom calls and while loops; small bucket set, each its own cold cache.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
for run in base cmdbuf; do
  F=""; [ $run = cmdbuf ] && F="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"
  XLA_FLAGS="$F" timeout 250 python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc8_$run --workloads w1 \
    --engine-args decode_buckets=1 prefill_token_buckets=1024 runner.vision_buckets=1 "runner.vision_image_batches=()" \
    --trace-dir /tmp/tr8_$run --out $OUT/8_w1_$run.json 2>&1 | grep -v "$FILT" > $OUT/8_w1_$run.log
done
grep -h "engine ready\|w1:\|trace w1\|rror" $OUT/8_w1_*.log | cut -c18-260
