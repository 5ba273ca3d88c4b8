# Planned, not run: the device time was spent (the call was refused). Command buffers on W1 and W2 with --host-profile.
export PYTHONPATH=$PWD:$PWD/.scratch/site
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
EA="decode_buckets=1,64 prefill_token_buckets=2048 runner.vision_buckets=2"
export XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"
rm -rf /tmp/cc
timeout 310 python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc --requests-per-client 6 --host-profile --w1-reps 2 --workloads w1,w2 --concurrency 64 --engine-args $EA --out $OUT/1_cb.json 2>&1 | grep -v "$FILT" > $OUT/1_cb.log
grep "w1\|w2 C=\|samples\|rror" $OUT/*.log | cut -c1-1500 | head -20
