# Session 14, call 9: does any kernel of the engine's steps access memory out of bounds? (Call 5's
# launch failure with no profiler running.) compute-sanitizer memcheck over a small W2 (8 clients,
# one 16-token image query each) on an engine with decode buckets 1-16; one buffer per allocation
# (XLA_PYTHON_CLIENT_ALLOCATOR=platform) so that memcheck sees each buffer's bounds; autotuning off
# (its candidate kernels would run under the sanitizer too).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer /opt/*/bin/compute-sanitizer 2>/dev/null | head -1)
[ -z "$CS" ] && CS=$(find /usr /opt -name compute-sanitizer -type f 2>/dev/null | head -1)
echo "sanitizer: ${CS:-none}" | tee $OUT/9_memcheck.log
[ -z "$CS" ] && exit 0
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 500 "$CS" --tool memcheck \
  --print-limit 30 python3 tools/benchmark.py --model md3 --random-weights --workloads w2 --concurrency 8 \
  --requests-per-client 1 --max-tokens 16 --warmup 0 --engine-args decode_buckets=1,2,4,8,16 prefill_token_buckets=1024 \
  runner.vision_buckets=1 "runner.vision_image_batches=()" --out $OUT/9_memcheck.json >> $OUT/9_memcheck.log 2>&1
echo "rc $?" >> $OUT/9_memcheck.log
grep -v "$FILT" $OUT/9_memcheck.log | grep -i "invalid\|error\|out of bounds\|w2 \|summary\|sanitizer\|rc " | head -40
