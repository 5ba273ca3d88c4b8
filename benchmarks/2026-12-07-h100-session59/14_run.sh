# Prepared in session 58 (2026-12-07) for any H100 / H200 (~8 device minutes; move it into the session's
# dated folder first). KESTREL_JAX_DENSE_OUT_MERGED=1 (built in session 58, not measured): a one-row dense
# layer's joined output + fc2 product forms its input row in its own launch (split-KV attention's merge
# from row 0's partials, fc1's GELU, the pad), removing the XLA fusion that did them (MD2's batch-1 step
# on an H100: 24 x 1.37 us = 2.6%). Note: the older merged-input GEMM (KESTREL_JAX_MERGED_PROJ) measured
# slower; this one reads row 0's partials alone and issues every load before its ring's fill.
# (1) GPU check, MD2 and MD3 (their first 4 layers, dense in both), on against off; (2) the MD2 batch-1
# probe A/B; (3) MD2 W1 off / on / on / off, each run its own process and compile cache. Make it the
# default only if the probe and both W1 pairs agree.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/14_env.txt
for M in md2 md3; do  # (the joined dense weights, as the runner has them; the first 4 layers: 3 / 3 hand-ons)
  timeout 90 python3 tools/check_decode_fusion.py --model $M --fused-dense-decode --layers 4 \
    --switch KESTREL_JAX_DENSE_OUT_MERGED=1,0 --batches 1 --out $OUT/14_check_$M.json 2>&1 | grep -v "$FILT" > $OUT/14_check_$M.log
  echo "check $M ($SECONDS s): $(grep 'switch\|rror' $OUT/14_check_$M.log | cut -c1-250 | tr '\n' ' ')"
done
timeout 150 python3 tools/probe_step_kernels.py --kernels 45 --top 30 --model md2 --kinds decode --batch 1 \
  --sets default KESTREL_JAX_DENSE_OUT_MERGED=1 --json $OUT/14_probe_md2.json 2>&1 | grep -v "$FILT" > $OUT/14_probe_md2.log
echo "probe ($SECONDS s):"; grep "^\[.*\] decode:\|rror\|kestrel_gemv_mosaic\|loop_pad\|  [-+]" $OUT/14_probe_md2.log | head -12 | cut -c1-150
A="--random-weights --workloads w1 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
for s in 0 1 1 0; do
  [ $SECONDS -gt 500 ] && break
  KESTREL_JAX_DENSE_OUT_MERGED=$s timeout $((590 - SECONDS)) python3 tools/benchmark.py --model md2 $A \
    --compile-cache /tmp/cc_md2_$s --out $OUT/14_w1_md2_m${s}_$SECONDS.json > /tmp/w1.log 2>&1
  echo "md2 merged $s ($SECONDS s): $(grep -o 'w1: .*of copy)' /tmp/w1.log)" | tee -a $OUT/14_w1.txt
  grep -i "error" /tmp/w1.log | head -3
done
