# Session 20, call 5: MD3's tau dot products formed in the MoE layers' decode QKV GEMM
# (gemv_rows tau_w: one more wgmma per column block) and summed by the QKV epilogue, instead of
# every epilogue program forming GELU over the whole row and two 6,144-long dots
# (KESTREL_JAX_TAU_DOTS, default on). Full-size forward on vs off at 1 and 8 rows; the batch-1
# step kernel by kernel on vs off; W1 on / off.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
timeout 90 python3 tools/check_decode_fusion.py --switch KESTREL_JAX_TAU_DOTS --batches 1 8 \
  --out $OUT/x/5_check.json 2>&1 | grep -v "$FILT" > $OUT/x/5_check.log
tail -4 $OUT/x/5_check.log
if grep -q max_rel $OUT/x/5_check.log; then
  for s in 1 0; do
    KESTREL_JAX_TAU_DOTS=$s timeout 80 python3 tools/probe_step_kernels.py --kernels 30 --model md3 --kinds decode \
      --batch 1 --json $OUT/x/5_probe1_td$s.json 2>&1 | grep -v "$FILT" > $OUT/x/5_probe1_td$s.log
  done
  python3 tools/diff_step_kernels.py $OUT/x/5_probe1_td0.json $OUT/x/5_probe1_td1.json 2>&1 | head -14
  EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
  i=0
  for s in 1 0; do
    i=$((i+1))
    KESTREL_JAX_TAU_DOTS=$s timeout 110 python3 tools/benchmark.py --model md3 --random-weights --workloads w1 \
      --compile-cache /tmp/cc_$i --engine-args $EA --out $OUT/x/5_w1_${i}_td$s.json 2>&1 | grep -v "$FILT" > $OUT/x/5_w1_${i}_td$s.log
    echo "run $i tau_dots=$s: $(grep "batch-1 decode tok/s\|rror" $OUT/x/5_w1_${i}_td$s.log | head -3 | tr '\n' ' ')"
  done
else
  grep -i "error" $OUT/x/5_check.log | tail -20
fi
cd $OUT && tar czf 5_all.tgz x && rm -rf x
