# Session 54 (2026-12-06), call 2 (any H100 / H200): the one-row dense residual add inside the next
# dense layer's rows kernel (KESTREL_JAX_DENSE_RESIDUAL_IN_ROWS=1: the joined output + fc2 product
# writes row-0 split partials, the next rows kernel forms x + finished partials before its LayerNorm;
# XLA's residual add fusion, ~1.57 us x 23 in MD2's step on an H100, goes). Kernel check, MD2 probe
# A/B, MD2 W1 B then A (own processes and compile caches), MD3 W1 (defaults) if time is left.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
X=/tmp/x2; rm -rf $X; mkdir -p $X
save() { tar czf $OUT/2_all.tgz -C /tmp x2; }
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $X/2_env.txt
timeout 90 python3 tools/check_ln_in_rows.py --dense --residual --draws 4 --out $X/2_check.json 2>&1 \
  | grep -v "$FILT" > $X/2_check.log
echo "check ($SECONDS s): rc ${PIPESTATUS[0]}"; cut -c1-330 $X/2_check.log | tail -5; save
timeout $((220 - SECONDS)) python3 tools/probe_step_kernels.py --kernels 45 --top 30 --model md2 --kinds decode \
  --batch 1 --sets default KESTREL_JAX_DENSE_RESIDUAL_IN_ROWS=1 --json $X/2_probe_md2.json 2>&1 \
  | grep -v "$FILT" > $X/2_probe_md2.log
echo "probe md2 ($SECONDS s):"; grep "^\[.*\] decode:\|rror\|gemv\|loop_add\|^decode:" $X/2_probe_md2.log | cut -c1-150; save
ARGS="--engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
for run in B A; do
  ENV="KESTREL_JAX_UNUSED=0"; [ $run = B ] && ENV="KESTREL_JAX_DENSE_RESIDUAL_IN_ROWS=1"
  [ $SECONDS -lt 420 ] && env $ENV timeout $((585 - SECONDS)) python3 tools/benchmark.py --model md2 --random-weights \
    --compile-cache /tmp/cc_$run --workloads w1 $ARGS --out $X/2_w1_md2_$run.json 2>&1 \
    | grep -v "$FILT" > $X/2_w1_md2_$run.log
  echo "md2 W1 $run [$ENV] ($SECONDS s): $(grep "w1:\|rror" $X/2_w1_md2_$run.log | cut -c1-150 | tr '\n' ' ')"; save
done
[ $SECONDS -lt 470 ] && timeout $((590 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights \
  --compile-cache /tmp/cc_md3 --workloads w1 $ARGS --out $X/2_w1_md3_A.json 2>&1 | grep -v "$FILT" > $X/2_w1_md3_A.log
echo "md3 W1 A ($SECONDS s): $(grep "w1:\|rror" $X/2_w1_md3_A.log | cut -c1-150 | tr '\n' ' ')"; save
