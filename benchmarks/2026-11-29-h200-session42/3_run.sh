# Session 42, call 3 (H200): issue 6's side-by-side run again with this session's code (the last
# one: session 37, call 3), the same script; prefill buckets now with 3072 (as W2 since session 40). Ours: MD3 W1 + W2 C=64 (16 requests per
# client), then Kestrel 0.4.2 through ../shared/peer (copied to .peer, its carry built on the CPU
# machine; MD3 then MD2, batch-1 TTFT/decode at 378 px and C=64 with 8 requests per client), then
# ours MD2 W1 + W2 C=64; the ratio table from benchmark.py compare. Cold compile caches.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x $OUT/x/peer
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/3_env.txt
W2ARGS="--concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
timeout 230 python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc_md3 \
  --workloads w1,w2 $W2ARGS --out $OUT/x/3_md3.json 2>&1 | grep -v "$FILT" > $OUT/x/3_md3.log
echo "md3 ($SECONDS s): $(grep "w1:\|w2 C=64\|rror" $OUT/x/3_md3.log | cut -c1-160 | tr '\n' ' ')"
OUT=$OUT/x/peer PEER_DEADLINE_S=$((520 - SECONDS)) PEER_BENCH_ARGS="--requests-per-client 8 --concurrency 64 --ttft-image-sizes 378" \
  bash .peer/run_device.sh > $OUT/x/3_peer.log 2>&1
echo "peer ($SECONDS s): $(tail -4 $OUT/x/3_peer.log | tr '\n' ' ')"
[ $SECONDS -lt 450 ] && timeout $((585 - SECONDS)) python3 tools/benchmark.py --model md2 --random-weights --compile-cache /tmp/cc_md2 \
  --workloads w1,w2 $W2ARGS --out $OUT/x/3_md2.json 2>&1 | grep -v "$FILT" > $OUT/x/3_md2.log
echo "md2 ($SECONDS s): $(grep "w1:\|w2 C=64\|rror" $OUT/x/3_md2.log | cut -c1-160 | tr '\n' ' ')"
[ $SECONDS -lt 540 ] && timeout $((590 - SECONDS)) python3 tools/benchmark.py --model md2 --random-weights --compile-cache /tmp/cc_md2 \
  --workloads w2 $W2ARGS --out $OUT/x/3_md2_warm.json 2>&1 | grep -v "$FILT" > $OUT/x/3_md2_warm.log
echo "md2 warm ($SECONDS s): $(grep "w2 C=64\|rror" $OUT/x/3_md2_warm.log | cut -c1-160 | tr '\n' ' ')"
python3 tools/benchmark.py compare --ours $OUT/x/3_md3.json $OUT/x/3_md2.json --peer $OUT/x/peer/md3.json $OUT/x/peer/md2.json \
  --out $OUT/x/3_compare.json 2>&1 | tail -30
cd $OUT && gzip x/3_md*.json; tar czf 3_all.tgz x && rm -rf x
