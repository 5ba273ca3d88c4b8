# Session 44, call 1 (H200): the GPU output check the dense output kernel waited for (session 43's
# KESTREL_JAX_GEMV_DENSE_OUT=4 against XLA, MD2 joined dense weights, batches 64 / 8 / 2; then MD3,
# whose four dense layers take the same path, at 64), then a same-run MD2 side-by-side with it on:
# ours MD2 W2 C=64 (cold cache), Kestrel 0.4.2 MD2 only (.peer), ours again (warm cache), the ratio.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x $OUT/x/peer
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/1_env.txt
timeout 150 python3 tools/check_decode_fusion.py --model md2 --fused-dense-decode \
  --switch KESTREL_JAX_GEMV_DENSE_OUT=4,0 --batches 64 8 2 --out $OUT/x/1_check_md2.json 2>&1 \
  | grep -v "$FILT" > $OUT/x/1_check_md2.log
echo "check md2 rc $? ($SECONDS s)"; tail -8 $OUT/x/1_check_md2.log
[ $SECONDS -lt 120 ] && timeout 90 python3 tools/check_decode_fusion.py --model md3 --fused-dense-decode \
  --switch KESTREL_JAX_GEMV_DENSE_OUT=4,0 --batches 64 --out $OUT/x/1_check_md3.json 2>&1 \
  | grep -v "$FILT" > $OUT/x/1_check_md3.log
echo "check md3 ($SECONDS s)"; tail -5 $OUT/x/1_check_md3.log
W2ARGS="--concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
export KESTREL_JAX_GEMV_DENSE_OUT=4
timeout 200 python3 tools/benchmark.py --model md2 --random-weights --compile-cache /tmp/cc_md2 \
  --workloads w2 $W2ARGS --out $OUT/x/1_md2.json 2>&1 | grep -v "$FILT" > $OUT/x/1_md2.log
echo "md2 ($SECONDS s): $(grep "w2 C=64\|rror" $OUT/x/1_md2.log | cut -c1-160 | tr '\n' ' ')"
OUT=$OUT/x/peer PEER_MODELS=moondream2 PEER_DEADLINE_S=$((545 - SECONDS)) \
  PEER_BENCH_ARGS="--requests-per-client 8 --concurrency 64 --ttft-image-sizes 378" \
  bash .peer/run_device.sh > $OUT/x/1_peer.log 2>&1
echo "peer ($SECONDS s): $(tail -4 $OUT/x/1_peer.log | tr '\n' ' ')"
[ $SECONDS -lt 545 ] && timeout $((590 - SECONDS)) python3 tools/benchmark.py --model md2 --random-weights \
  --compile-cache /tmp/cc_md2 --workloads w2 $W2ARGS --out $OUT/x/1_md2_warm.json 2>&1 \
  | grep -v "$FILT" > $OUT/x/1_md2_warm.log
echo "md2 warm ($SECONDS s): $(grep "w2 C=64\|rror" $OUT/x/1_md2_warm.log | cut -c1-160 | tr '\n' ' ')"
[ -f $OUT/x/peer/md2.json ] && python3 tools/benchmark.py compare --ours $OUT/x/1_md2.json --peer $OUT/x/peer/md2.json \
  --out $OUT/x/1_compare.json 2>&1 | tail -20
cd $OUT && gzip x/1_md*.json; tar czf 1_all.tgz x && rm -rf x
