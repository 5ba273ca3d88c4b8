# Session 50, call 3 (carry [".peer"]): MD2 beside Kestrel 0.4.2's MD2 in one call, this session's
# defaults: W2 at 64 clients (issue 6: >= 1.5x Kestrel's output tok/s; session 48 ran ours without
# Kestrel MD2 in the call), then the peer's MD2 (batch 1 at 378 px and 64 clients, 8 requests each),
# then our MD2 W1 if time is left.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x $OUT/x/peer
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/3_env.txt
ARGS="--engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
timeout 230 python3 tools/benchmark.py --model md2 --random-weights --compile-cache /tmp/cc_md2 \
  --workloads w2 --concurrency 64 --requests-per-client 16 $ARGS --out $OUT/x/3_md2_w2.json 2>&1 \
  | grep -v "$FILT" > $OUT/x/3_md2_w2.log
echo "md2 W2 ($SECONDS s): $(grep "w2 C=64\|rror" $OUT/x/3_md2_w2.log | cut -c1-200 | tr '\n' ' ')"
OUT=$OUT/x/peer PEER_MODELS=moondream2 PEER_DEADLINE_S=$((470 - SECONDS)) \
  PEER_BENCH_ARGS="--requests-per-client 8 --concurrency 64 --ttft-image-sizes 378" \
  bash .peer/run_device.sh > $OUT/x/3_peer.log 2>&1
echo "peer ($SECONDS s): $(grep -h SUMMARY $OUT/x/peer/*.log | cut -c1-300 | tr '\n' ' ')"; tail -3 $OUT/x/3_peer.log | cut -c1-200
[ $SECONDS -lt 440 ] && timeout $((585 - SECONDS)) python3 tools/benchmark.py --model md2 --random-weights \
  --compile-cache /tmp/cc_md2 --workloads w1 $ARGS --out $OUT/x/3_md2_w1.json 2>&1 \
  | grep -v "$FILT" > $OUT/x/3_md2_w1.log
echo "md2 W1 ($SECONDS s): $(grep "w1:\|rror" $OUT/x/3_md2_w1.log | cut -c1-150 | tr '\n' ' ')"
cd $OUT && gzip -f x/3_md*.json x/peer/*.json 2>/dev/null; tar czf 3_all.tgz x && rm -rf x
