# Prepared in session 47 (2026-12-03) for the next session's first call (H200, carry [".peer"]):
# (1) since session 47 the decode steps hand the sampler bf16 logits, and its kernels read bf16
# ~0.5 us slower than f32 at batch 1 (the tile width, 128 tokens, is the f32 one): sweep widths and
# warps for bf16 (`--configs width:warps`) at the decode batches; (2) W2 at 64 clients, which no
# session has run since session 44 (the bf16 logits reach the 64-row steps too; sessions 45-47's
# other changes are one-row only), MD3 then MD2, beside Kestrel 0.4.2 MD3 in the same call.
# Move this file into the session's dated folder before running it.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x $OUT/x/peer
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/1_env.txt
timeout 110 python3 tools/bench_sampling.py --quick --batches 1,8,64 --settings greedy,md3_query \
  --configs 256:8,512:8,256:16,128:4 --budget-s 90 --out $OUT/x/1_sampling.json 2>&1 | grep -v "$FILT" > $OUT/x/1_sampling.log
echo "sampling ($SECONDS s):"; tail -25 $OUT/x/1_sampling.log | cut -c1-160
W2ARGS="--concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
timeout 200 python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc_md3 \
  --workloads w2 $W2ARGS --out $OUT/x/1_md3_w2.json 2>&1 | grep -v "$FILT" > $OUT/x/1_md3_w2.log
echo "md3 W2 ($SECONDS s): $(grep "w2 C=64\|rror" $OUT/x/1_md3_w2.log | cut -c1-160 | tr '\n' ' ')"
OUT=$OUT/x/peer PEER_MODELS=moondream3-preview PEER_DEADLINE_S=$((470 - SECONDS)) \
  PEER_BENCH_ARGS="--requests-per-client 8 --concurrency 64 --ttft-image-sizes 378" \
  bash .peer/run_device.sh > $OUT/x/1_peer.log 2>&1
echo "peer ($SECONDS s): $(tail -4 $OUT/x/1_peer.log | cut -c1-300 | tr '\n' ' ')"
[ $SECONDS -lt 420 ] && timeout $((590 - SECONDS)) python3 tools/benchmark.py --model md2 --random-weights \
  --compile-cache /tmp/cc_md2 --workloads w2 $W2ARGS --out $OUT/x/1_md2_w2.json 2>&1 \
  | grep -v "$FILT" > $OUT/x/1_md2_w2.log
echo "md2 W2 ($SECONDS s): $(grep "w2 C=64\|rror" $OUT/x/1_md2_w2.log | cut -c1-160 | tr '\n' ' ')"
[ -f $OUT/x/peer/md3.json ] && python3 tools/benchmark.py compare --ours $OUT/x/1_md3_w2.json \
  --peer $OUT/x/peer/md3.json --out $OUT/x/1_compare.json 2>&1 | tail -20
cd $OUT && gzip -f x/1_md*.json; tar czf 1_all.tgz x && rm -rf x
