# Prepared in session 46 (2026-11-30) for the next session's first call (H200, carry [".peer"]):
# batch-1 decode side by side with Kestrel in one call, which no session has run since the
# defaults of sessions 44-46 (dense one-row output product and LayerNorm, the MoE output projection
# in the down GEMM's launch): ours MD3 W1, Kestrel 0.4.2 MD3 (batch-1 phase only), ours MD2 W1.
# Run as session 47's first call (2026-12-03).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x $OUT/x/peer
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/1_env.txt
ARGS="--engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
timeout 200 python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc_md3 \
  --workloads w1 $ARGS --out $OUT/x/1_md3_w1.json 2>&1 | grep -v "$FILT" > $OUT/x/1_md3_w1.log
echo "md3 W1 ($SECONDS s): $(grep "w1:\|rror" $OUT/x/1_md3_w1.log | cut -c1-120 | tr '\n' ' ')"
OUT=$OUT/x/peer PEER_MODELS=moondream3-preview PEER_DEADLINE_S=$((430 - SECONDS)) \
  PEER_BENCH_ARGS="--concurrency 1 --requests-per-client 1 --ttft-image-sizes 378" \
  bash .peer/run_device.sh > $OUT/x/1_peer.log 2>&1
echo "peer ($SECONDS s): $(tail -4 $OUT/x/1_peer.log | tr '\n' ' ')"
[ $SECONDS -lt 460 ] && timeout $((590 - SECONDS)) python3 tools/benchmark.py --model md2 --random-weights \
  --compile-cache /tmp/cc_md2 --workloads w1 $ARGS --out $OUT/x/1_md2_w1.json 2>&1 \
  | grep -v "$FILT" > $OUT/x/1_md2_w1.log
echo "md2 W1 ($SECONDS s): $(grep "w1:\|rror" $OUT/x/1_md2_w1.log | cut -c1-120 | tr '\n' ' ')"
cd $OUT && tar czf 1_all.tgz x && rm -rf x
