# Prepared in session 48 (2026-12-03), run in session 53 (2026-12-06) as call 3 (H200, carry
# [".peer"]), with session 53's defaults (the LayerNorm inside the rows kernel for MoE and dense
# layers at one row: +1.4% MD3 W1 on an H100). (1) MD3 W1 beside Kestrel 0.4.2's MD3 and MD2 in one
# call, so the batch-1 ratios come from one machine again; (2) MD2 W2 at 64 clients beside Kestrel
# MD2 (session 48 ran MD2 W2 at 9,798 without Kestrel MD2 in its call). Outputs tarred into $OUT
# after each stage.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
X=/tmp/x5; rm -rf $X; mkdir -p $X/peer
save() { tar czf $OUT/5_all.tgz -C /tmp x5; }
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $X/5_env.txt
ARGS="--engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
timeout 200 python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc_md3 \
  --workloads w1 $ARGS --out $X/5_md3_w1.json 2>&1 | grep -v "$FILT" > $X/5_md3_w1.log
echo "md3 W1 ($SECONDS s): $(grep "w1:\|rror" $X/5_md3_w1.log | cut -c1-120 | tr '\n' ' ')"; save
OUT=$X/peer PEER_DEADLINE_S=$((400 - SECONDS)) \
  PEER_BENCH_ARGS="--requests-per-client 8 --concurrency 64 --ttft-image-sizes 378" \
  bash .peer/run_device.sh > $X/5_peer.log 2>&1
echo "peer ($SECONDS s): $(grep SUMMARY $X/5_peer.log | cut -c1-300 | tr '\n' ' ')"; save
W2ARGS="--concurrency 64 --requests-per-client 16 $ARGS"
[ $SECONDS -lt 420 ] && timeout $((570 - SECONDS)) python3 tools/benchmark.py --model md2 --random-weights \
  --compile-cache /tmp/cc_md2 --workloads w2 $W2ARGS --out $X/5_md2_w2.json 2>&1 \
  | grep -v "$FILT" > $X/5_md2_w2.log
echo "md2 W2 ($SECONDS s): $(grep "w2 C=64\|rror" $X/5_md2_w2.log | cut -c1-160 | tr '\n' ' ')"; save
