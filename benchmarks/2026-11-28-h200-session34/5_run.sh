# Session 34, call 5 (H200): call 4 measured MD2 W2 with the prefill QKV kernel at 9,415 / 9,422
# output tok/s against 9,319 / 9,344 without (+0.9%). Now the QKV bias of MD2's decode layers added
# in the decode epilogue kernel instead of an XLA add after the GEMM (KESTREL_JAX_QKV_BIAS_IN_EPILOGUE,
# new): (1) hidden states on vs off at 1 and 64 rows (tools/check_decode_fusion.py); (2) MD2 decode
# step A/B at 64 and 1 rows (probe --ab); (3) MD2 W2 C=64 off / on (own compile caches); (4) if time
# is left, MD2 W1 off / on.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/5_env.txt
SW=KESTREL_JAX_QKV_BIAS_IN_EPILOGUE
timeout 120 python3 tools/check_decode_fusion.py --model md2 --switch $SW --batches 1 64 --out $OUT/x/5_check.json 2>&1 \
  | grep -v "$FILT" > $OUT/x/5_check.log
echo "check ($SECONDS s):"; grep "max_rel\|rror" $OUT/x/5_check.log | cut -c1-200
for B in 64 1; do
  timeout 150 python3 tools/probe_step_kernels.py --kernels 20 --top 20 --model md2 --kinds decode --batch $B \
    --context 800 --steps 1 --wall-rounds 5 --ab $SW=0,1 --json $OUT/x/5_probe_b$B.json 2>&1 | grep -v "$FILT" > $OUT/x/5_probe_b$B.log
  echo "probe b$B ($SECONDS s):"; grep "launches (\|rror" $OUT/x/5_probe_b$B.log | cut -c1-200
done
W2="--concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1"
i=0
for v in 0 1; do
  i=$((i+1))
  [ $SECONDS -gt 330 ] && { echo "skip w2 $i ($v): $SECONDS s"; continue; }
  env $SW=$v timeout $((560 - SECONDS)) python3 tools/benchmark.py --model md2 --random-weights \
    --compile-cache /tmp/cc_md2_b$v --workloads w2 $W2 --out $OUT/x/5_w2_${i}_b$v.json 2>&1 | grep -v "$FILT" > $OUT/x/5_w2_${i}_b$v.log
  echo "w2 $i b=$v ($SECONDS s): $(grep "w2 C=64\|rror" $OUT/x/5_w2_${i}_b$v.log | cut -c1-150 | head -2 | tr '\n' ' ')"
done
for v in 0 1; do
  [ $SECONDS -gt 480 ] && { echo "skip w1 ($v): $SECONDS s"; continue; }
  env $SW=$v timeout $((585 - SECONDS)) python3 tools/benchmark.py --model md2 --random-weights \
    --compile-cache /tmp/cc_md2_w1_b$v --workloads w1 --engine-args decode_buckets=1 prefill_token_buckets=1024 \
    --out $OUT/x/5_w1_b$v.json 2>&1 | grep -v "$FILT" > $OUT/x/5_w1_b$v.log
  echo "w1 b=$v ($SECONDS s): $(grep "w1\b.*tok/s\|w1:\|rror" $OUT/x/5_w1_b$v.log | cut -c1-150 | head -2 | tr '\n' ' ')"
done
cd $OUT && tar czf 5_all.tgz x && rm -rf x
