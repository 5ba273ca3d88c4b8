# Session 20, call 4: the residual + LayerNorm launch now also takes the output projection as
# finished padded rows (gemv_mgpu.gemv_rows, KESTREL_JAX_PROJ_ROWS, default on) instead of XLA summing
# the split partials and adding the bias in a launch of its own (call 3: that launch, 1.47 us x 19,
# ate the gain). Full-size forward PROJ_ROWS on vs off at 1 row; batch-1 step kernel by kernel with
# the defaults vs KESTREL_JAX_RESIDUAL_LN=0; W1 defaults / RESIDUAL_LN=0.
# (KESTREL_JAX_PROJ_ROWS was removed after this call: the unsplit projection rows measured slower.)
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
timeout 80 python3 tools/check_decode_fusion.py --switch KESTREL_JAX_PROJ_ROWS KESTREL_JAX_RESIDUAL_LN --batches 1 \
  --out $OUT/x/4_check.json 2>&1 | grep -v "$FILT" > $OUT/x/4_check.log
tail -2 $OUT/x/4_check.log
for s in 1 0; do
  KESTREL_JAX_RESIDUAL_LN=$s timeout 80 python3 tools/probe_step_kernels.py --kernels 30 --model md3 --kinds decode \
    --batch 1 --json $OUT/x/4_probe1_rl$s.json 2>&1 | grep -v "$FILT" > $OUT/x/4_probe1_rl$s.log
done
python3 tools/diff_step_kernels.py $OUT/x/4_probe1_rl0.json $OUT/x/4_probe1_rl1.json 2>&1 | head -14
EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
i=0
for s in 1 0; do
  i=$((i+1))
  KESTREL_JAX_RESIDUAL_LN=$s timeout 110 python3 tools/benchmark.py --model md3 --random-weights --workloads w1 \
    --compile-cache /tmp/cc_$i --engine-args $EA --out $OUT/x/4_w1_${i}_rl$s.json 2>&1 | grep -v "$FILT" > $OUT/x/4_w1_${i}_rl$s.log
  echo "run $i residual_ln=$s: $(grep "batch-1 decode tok/s\|rror" $OUT/x/4_w1_${i}_rl$s.log | head -3 | tr '\n' ' ')"
done
cd $OUT && tar czf 4_all.tgz x && rm -rf x
