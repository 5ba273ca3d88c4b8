# Session 18, call 1: the dense W8A16 MoE regime's UP and DOWN in one clustered launch
# (moe_mgpu._fused_up_down, KESTREL_JAX_MOE_FUSED=0 restores the two grouped GEMMs). The layer at
# T = 1, 2, 3 on and off (checked against the reference), the full-size forward on vs off, then W1.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/1_env.txt
for run in on off; do
  if [ $run = off ]; then export KESTREL_JAX_MOE_FUSED=0; else unset KESTREL_JAX_MOE_FUSED; fi
  timeout 100 python3 tools/bench_moe.py --tokens 1,2,3 --precisions fp8 --no-routing-ab --no-baselines \
    --out $OUT/1_moe_$run.json 2>&1 | grep -v "$FILT" > $OUT/1_moe_$run.log
done
unset KESTREL_JAX_MOE_FUSED
timeout 100 python3 tools/check_decode_fusion.py --switch KESTREL_JAX_MOE_FUSED --batches 1 2 \
  --out $OUT/1_check.json 2>&1 | grep -v "$FILT" > $OUT/1_check.log
EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
for run in on off; do
  if [ $run = off ]; then export KESTREL_JAX_MOE_FUSED=0; else unset KESTREL_JAX_MOE_FUSED; fi
  echo "### $run" >> $OUT/1_w1.log
  timeout 110 python3 tools/benchmark.py --model md3 --random-weights --workloads w1 --compile-cache /tmp/cc_$run \
    --engine-args $EA --out /tmp/1_w1_$run.json 2>&1 | grep -v "$FILT" >> $OUT/1_w1.log
done
tail -12 $OUT/1_moe_on.log; tail -8 $OUT/1_moe_off.log; tail -6 $OUT/1_check.log; grep -h "###\|w1:\|rror" $OUT/1_w1.log | cut -c1-200
