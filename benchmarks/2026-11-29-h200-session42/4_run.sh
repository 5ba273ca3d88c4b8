# Session 42, call 4 (H200): call 3 had MD2 W2 at C=64 1.494x Kestrel's (9,798.1 against 6,557.6
# output tok/s; target 1.5x), against 10,000-10,030 for ours in the forty-first session: a second
# MD2 pair on another machine (Kestrel 0.4.2 MD2 only through ../shared/peer, then ours W2 cold and
# warm, the same arguments as call 3), then issue 3's target table again (`--targets`, a second
# sample: call 2 had the 740-token prefill at 19.91 us against 19.9).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x $OUT/x/peer
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/4_env.txt
W2ARGS="--concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
OUT=$OUT/x/peer PEER_MODELS=moondream2 PEER_DEADLINE_S=150 PEER_BENCH_ARGS="--requests-per-client 8 --concurrency 64 --ttft-image-sizes 378" \
  bash .peer/run_device.sh > $OUT/x/4_peer.log 2>&1
echo "peer ($SECONDS s): $(grep "concurrency 64" $OUT/x/peer/*.log $OUT/x/4_peer.log | cut -c1-200 | head -2 | tr '\n' ' ')"
for r in cold warm; do
  [ $SECONDS -gt 400 ] && { echo "skip md2 $r: $SECONDS s"; continue; }
  timeout $((560 - SECONDS)) python3 tools/benchmark.py --model md2 --random-weights --compile-cache /tmp/cc_md2 \
    --workloads w2 $W2ARGS --out $OUT/x/4_md2_$r.json 2>&1 | grep -v "$FILT" > $OUT/x/4_md2_$r.log
  echo "md2 $r ($SECONDS s): $(grep "w2 C=64\|rror" $OUT/x/4_md2_$r.log | cut -c1-160 | tr '\n' ' ')"
done
[ $SECONDS -lt 420 ] && timeout $((588 - SECONDS)) python3 tools/bench_attention.py --targets --budget-s $((540 - SECONDS)) \
  --out $OUT/x/4_attention.json 2>&1 | grep -v "$FILT" > $OUT/x/4_attention.log
echo "targets ($SECONDS s):"; grep "^  ('" $OUT/x/4_attention.log | cut -c1-120
cd $OUT && gzip x/4_md*.json; tar czf 4_all.tgz x && rm -rf x
