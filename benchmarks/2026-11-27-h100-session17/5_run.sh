# Session 17, call 5: programmatic dependent launch for the MoE's two GEMMs (KESTREL_JAX_MOE_PDL=1:
# the up GEMM lets the next kernel launch at its start; the down GEMM loads its block table and
# first weight tiles, then waits for the up GEMM's results). GPU check that the forward is unchanged
# (1 row: W8A16; 4 rows: W8A8 with the quantisation between the GEMMs), then W1 on/off/on.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
timeout 120 python3 tools/check_decode_fusion.py --switch KESTREL_JAX_MOE_PDL --batches 1 4 \
  --out $OUT/5_check.json 2>&1 | grep -v "$FILT" > $OUT/5_check.log
EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
for run in pdl off pdl2; do
  if [ $run = off ]; then unset KESTREL_JAX_MOE_PDL; else export KESTREL_JAX_MOE_PDL=1; fi
  echo "### $run" >> $OUT/5_w1.log
  timeout 110 python3 tools/benchmark.py --model md3 --random-weights --workloads w1 --compile-cache /tmp/cc_$run \
    --engine-args $EA --out /tmp/5_w1_$run.json 2>&1 | grep -v "$FILT" >> $OUT/5_w1.log
done
cat $OUT/5_check.log | tail -5; grep -h "###\|w1:\|rror" $OUT/5_w1.log | cut -c1-200
