# Session 20, call 3: the residual of a decode MoE layer formed in the next MoE layer's LayerNorm
# launch (layer_norm_triton.residual_layer_norm_rows_kernel, KESTREL_JAX_RESIDUAL_LN, default on):
# full-size forward on vs off at 1 row, the batch-1 step kernel by kernel on vs off, then W1
# on / off / on / off (each its own process and cold compile cache).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
timeout 80 python3 tools/check_decode_fusion.py --switch KESTREL_JAX_RESIDUAL_LN --batches 1 \
  --out $OUT/x/3_check.json 2>&1 | grep -v "$FILT" > $OUT/x/3_check.log
tail -1 $OUT/x/3_check.log
for s in 1 0; do
  KESTREL_JAX_RESIDUAL_LN=$s timeout 80 python3 tools/probe_step_kernels.py --kernels 30 --model md3 --kinds decode \
    --batch 1 --json $OUT/x/3_probe1_rl$s.json 2>&1 | grep -v "$FILT" > $OUT/x/3_probe1_rl$s.log
done
python3 tools/diff_step_kernels.py $OUT/x/3_probe1_rl0.json $OUT/x/3_probe1_rl1.json 2>&1 | head -14
EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
i=0
for s in 1 0 1 0; do
  i=$((i+1))
  KESTREL_JAX_RESIDUAL_LN=$s timeout 110 python3 tools/benchmark.py --model md3 --random-weights --workloads w1 \
    --compile-cache /tmp/cc_$i --engine-args $EA --out $OUT/x/3_w1_${i}_rl$s.json 2>&1 | grep -v "$FILT" > $OUT/x/3_w1_${i}_rl$s.log
  echo "run $i residual_ln=$s: $(grep "batch-1 decode tok/s\|rror" $OUT/x/3_w1_${i}_rl$s.log | head -3 | tr '\n' ' ')"
done
cd $OUT && tar czf 3_all.tgz x && rm -rf x
