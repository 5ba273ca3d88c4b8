# Prepared in session 48 (2026-12-03) for the next session's first call (H200, carry [".peer"]):
# Still wanted after sessions 49-51 (H100s only): it now also gives the first H200 W1 with MD3's
# joined dense input at one row (session 51's default, +0.9% on an H100).
# (1) MD3 W1 with session 48's default (the MoE up GEMM merges split-KV attention's partials,
# measured 912.7 -> 931.1 tok/s in one pair) beside Kestrel 0.4.2's MD3 and MD2 in one call, so the
# batch-1 ratios come from one machine again; (2) MD2 W2 at 64 clients beside Kestrel MD2 (session
# 48 ran MD2 W2 at 9,798 without Kestrel MD2 in its call). Move this file into the session's dated
# folder before running it.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x $OUT/x/peer
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/1_env.txt
ARGS="--engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
timeout 200 python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc_md3 \
  --workloads w1 $ARGS --out $OUT/x/1_md3_w1.json 2>&1 | grep -v "$FILT" > $OUT/x/1_md3_w1.log
echo "md3 W1 ($SECONDS s): $(grep "w1:\|rror" $OUT/x/1_md3_w1.log | cut -c1-120 | tr '\n' ' ')"
OUT=$OUT/x/peer PEER_DEADLINE_S=$((420 - SECONDS)) \
  PEER_BENCH_ARGS="--requests-per-client 8 --concurrency 64 --ttft-image-sizes 378" \
  bash .peer/run_device.sh > $OUT/x/1_peer.log 2>&1
echo "peer ($SECONDS s): $(grep SUMMARY $OUT/x/1_peer.log | cut -c1-300 | tr '\n' ' ')"
W2ARGS="--concurrency 64 --requests-per-client 16 $ARGS"
[ $SECONDS -lt 430 ] && timeout $((590 - SECONDS)) python3 tools/benchmark.py --model md2 --random-weights \
  --compile-cache /tmp/cc_md2 --workloads w2 $W2ARGS --out $OUT/x/1_md2_w2.json 2>&1 \
  | grep -v "$FILT" > $OUT/x/1_md2_w2.log
echo "md2 W2 ($SECONDS s): $(grep "w2 C=64\|rror" $OUT/x/1_md2_w2.log | cut -c1-160 | tr '\n' ' ')"
cd $OUT && gzip -f x/1_md*.json x/peer/*.json 2>/dev/null; tar czf 1_all.tgz x && rm -rf x
