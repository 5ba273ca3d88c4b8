# Session 47, call 3 (H200, carry [".peer"]): the new one-row defaults for MD2 (a dense layer's
# QKV + fc1 as the joined product at one row, KESTREL_JAX_DENSE_IN_ONE_ROW default on without tau,
# the QKV epilogue reading its columns in place, KESTREL_JAX_DECODE_QKV_WIDE default on at one row):
# the GPU output check (on = the new defaults, off = =0), MD2 W1 with the defaults, Kestrel 0.4.2
# MD2 batch-1 beside it, then an MD3 batch-1 probe of the joined product for its tau layers
# (opt-in =1, no in-place read), and a second MD2 W1 run if time is left.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x $OUT/x/peer
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/3_env.txt
timeout 90 python3 tools/check_decode_fusion.py --model md2 --fused-dense-decode \
  --switch KESTREL_JAX_DENSE_IN_ONE_ROW --batches 1 --out $OUT/x/3_check.json 2>&1 | grep -v "$FILT" > $OUT/x/3_check.log
echo "check ($SECONDS s):"; grep "max_rel\|rror" $OUT/x/3_check.log | cut -c1-200
ARGS="--engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
timeout 180 python3 tools/benchmark.py --model md2 --random-weights --compile-cache /tmp/cc_md2 \
  --workloads w1 $ARGS --out $OUT/x/3_md2_w1.json 2>&1 | grep -v "$FILT" > $OUT/x/3_md2_w1.log
echo "md2 W1 ($SECONDS s): $(grep "w1:\|rror" $OUT/x/3_md2_w1.log | cut -c1-120 | tr '\n' ' ')"
OUT=$OUT/x/peer PEER_MODELS=moondream2 PEER_DEADLINE_S=$((400 - SECONDS)) \
  PEER_BENCH_ARGS="--concurrency 1 --requests-per-client 1 --ttft-image-sizes 378" \
  bash .peer/run_device.sh > $OUT/x/3_peer.log 2>&1
echo "peer ($SECONDS s): $(tail -4 $OUT/x/3_peer.log | cut -c1-400 | tr '\n' ' ')"
[ $SECONDS -lt 420 ] && timeout $((530 - SECONDS)) python3 tools/probe_step_kernels.py --kernels 40 --top 30 \
  --model md3 --kinds decode --batch 1 --sets default KESTREL_JAX_DENSE_IN_ONE_ROW=1 \
  --json $OUT/x/3_probe_md3.json 2>&1 | grep -v "$FILT" > $OUT/x/3_probe_md3.log
echo "probe ($SECONDS s):"; grep "^\[.*\] decode:\|rror" $OUT/x/3_probe_md3.log | cut -c1-150
[ $SECONDS -lt 470 ] && timeout $((590 - SECONDS)) python3 tools/benchmark.py --model md2 --random-weights \
  --compile-cache /tmp/cc_md2 --workloads w1 $ARGS --out $OUT/x/3_md2_w1_2.json 2>&1 \
  | grep -v "$FILT" > $OUT/x/3_md2_w1_2.log
echo "md2 W1 again ($SECONDS s): $(grep "w1:\|rror" $OUT/x/3_md2_w1_2.log | cut -c1-120 | tr '\n' ' ')"
cd $OUT && tar czf 3_all.tgz x && rm -rf x
