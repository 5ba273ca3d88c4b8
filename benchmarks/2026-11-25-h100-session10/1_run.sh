# Session 10, call 1: first GPU start-up with compile_threads=8 (cold), then vision_thread A/B (warm),
# Output files renamed on copy: 1_base, 1_vthread, 1_cb (this call's 1_base, 2_vthread, 3_cb).
# then XLA command buffers (incl. WHILE: the K-step scan) on W1 and W2, each with --host-profile.
export PYTHONPATH=$PWD:$PWD/.scratch/site
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
EA="decode_buckets=1,64 prefill_token_buckets=2048 runner.vision_buckets=2"
B="python3 tools/benchmark.py --model md3 --random-weights --requests-per-client 6 --host-profile --w1-reps 2 --concurrency 64"
rm -rf /tmp/cc /tmp/cc2
timeout 240 $B --compile-cache /tmp/cc --workloads w1,w2 --engine-args $EA --out $OUT/1_base.json 2>&1 | grep -v "$FILT" > $OUT/1_base.log
timeout 90 $B --compile-cache /tmp/cc --workloads w2 --engine-args $EA vision_thread=True --out $OUT/2_vthread.json 2>&1 | grep -v "$FILT" > $OUT/2_vthread.log
export XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"
timeout 240 $B --compile-cache /tmp/cc2 --workloads w1,w2 --engine-args $EA --out $OUT/3_cb.json 2>&1 | grep -v "$FILT" > $OUT/3_cb.log
grep "engine ready\|w1 \|w1:\|w2 C=\|samples\|rror" $OUT/*.log | cut -c1-1200 | head -40
