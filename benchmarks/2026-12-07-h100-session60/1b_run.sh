# Session 57 split 1_run.sh in two calls (1a_run.sh: our W1; 1b_run.sh: Kestrel, then MD2 W2) after its first
# call was taken back mid-run with nothing returned; neither stage ran (no H200 came in session 57).
# Run 1a, then 1b on the same machine kept warm (1b carries [".peerx"]); move both into the
# session's dated folder first.
# Prepared in session 53 for an H200 (kind nvidia-h200, carry [".peerx"]: .peer with its big wheel packed
# by `bash tools/peer_carry.sh pack`, since .peer and the tree passed 64 MiB). Session 56 ran it on the H100
# it was lent instead (benchmarks/2026-12-07-h100-session56/1_*); on an H200 it is still wanted. Move this
# file into the session's dated folder before running it.
# Issue 6's batch-1 targets are quoted on an H200 (session 48: MD3 W1 931.1, MD2 944.1 tok/s; on H100s
# since: sessions 51 and 53 +0.9% and +1.4% on MD3 W1, session 54 +1.6% on MD2, session 56 +2.0% MD3 and
# +2.5% MD2). (1) MD3 and MD2 W1 with the current defaults, (2) Kestrel 0.4.2's MD3 and MD2 in the same
# call, (3) MD2 W2 at 64 clients if time is left. Outputs tarred into $OUT after each stage.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
bash tools/peer_carry.sh unpack > /tmp/unpack.log 2>&1 || { echo unpack failed; cat /tmp/unpack.log; }
X=/tmp/x1; mkdir -p $X/peer
save() { tar czf $OUT/1b_all.tgz -C /tmp x1; }
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $X/1_env.txt
ARGS="--engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
OUT=$X/peer PEER_DEADLINE_S=$((300 - SECONDS)) \
  PEER_BENCH_ARGS="--requests-per-client 8 --concurrency 64 --ttft-image-sizes 378" \
  bash .peer/run_device.sh > $X/1_peer.log 2>&1
echo "peer ($SECONDS s): $(grep SUMMARY $X/1_peer.log | cut -c1-300 | tr '\n' ' ')"; save
W2ARGS="--concurrency 64 --requests-per-client 16 $ARGS"
[ $SECONDS -lt 320 ] && timeout $((580 - SECONDS)) python3 tools/benchmark.py --model md2 --random-weights \
  --compile-cache /tmp/cc_md2 --workloads w2 $W2ARGS --out $X/1_md2_w2.json 2>&1 \
  | grep -v "$FILT" > $X/1_md2_w2.log
echo "md2 W2 ($SECONDS s): $(grep "w2 C=64\|rror" $X/1_md2_w2.log | cut -c1-160 | tr '\n' ' ')"; save
