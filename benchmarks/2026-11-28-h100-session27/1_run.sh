# Session 27, call 1: W2 (C=64) with the GIL switch interval at 0.5 ms against the interpreter's 5 ms,
# A/B/A/B in one call, all runs sharing one compile cache (same executables). Session 26's traces had
# the device idle in ~5 ms gaps before steps: 5 ms is Python's default switch interval, the most a
# thread that gave up the GIL (device call, transfer, output wait) waits to take it back from a
# thread running Python (vision thread, event loop, image preparation).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/1_env.txt
i=0
for v in base gil05 base gil05 gil05_defer; do
  i=$((i+1))
  [ $SECONDS -gt 470 ] && { echo "skip run $i ($v): $SECONDS s"; continue; }
  extra=""
  case $v in gil05) extra="gil_switch_interval_ms=0.5";; gil05_defer) extra="gil_switch_interval_ms=0.5 defer_unready_images=True";; esac
  timeout $((585 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc_w2 \
    --workloads w2 --concurrency 64 --requests-per-client 16 \
    --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1 $extra \
    --out $OUT/x/1_w2_${i}_$v.json 2>&1 | grep -v "$FILT" > $OUT/x/1_w2_${i}_$v.log
  echo "run $i $v ($SECONDS s): $(grep "engine ready\|output tok/s\|rror" $OUT/x/1_w2_${i}_$v.log | cut -c1-200 | head -3 | tr '\n' ' ')"
done
cd $OUT && tar czf 1_all.tgz x && rm -rf x
