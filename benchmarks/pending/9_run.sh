# Prepared in session 57 (2026-12-07) for any H100 / H200 (~6 device minutes; move it into the session's
# dated folder first; run it after 8_run.sh, only if 8_run's md2_k2 or md2_k2_st4 beat md2 there). MD2's
# one-row joined QKV + fc1 rows kernel (224 CTAs on 132 SMs) in clusters of 2 CTAs splitting K
# (KESTREL_JAX_ROWS_K_SPLIT_DENSE=2, 448 CTAs): (1) GPU check against the unsplit kernel (one row, 2 layers);
# (2) MD2 W1, default against the switch, each run its own process and compile cache, alternating.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/9_env.txt
timeout 120 python3 tools/check_decode_fusion.py --model md2 --switch KESTREL_JAX_ROWS_K_SPLIT_DENSE=2,1 \
  --batches 1 --layers 2 --out $OUT/9_check.json 2>&1 | grep -v "$FILT" > $OUT/9_check.log
tail -3 $OUT/9_check.log
A="--random-weights --workloads w1 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
for s in 1 2 2 1; do
  [ $SECONDS -gt 440 ] && break
  KESTREL_JAX_ROWS_K_SPLIT_DENSE=$s timeout $((590 - SECONDS)) python3 tools/benchmark.py --model md2 $A \
    --compile-cache /tmp/cc_md2_k$s --out $OUT/9_w1_md2_k${s}_$SECONDS.json > /tmp/w1.log 2>&1
  echo "md2 dense rows k_split $s ($SECONDS s): $(grep -o 'w1: .*of copy)' /tmp/w1.log)" | tee -a $OUT/9_w1.txt
  grep -i "error" /tmp/w1.log | head -3
done
