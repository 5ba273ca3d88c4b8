# Session 21, call 1: on an H100, (a) the tau dots (default on since session 20, measured on an
# H200 only) and (b) the LayerNorm kernel writing the up GEMM's e4m3 rows (opt-in
# KESTREL_JAX_LN_QUANT, built in session 20, never measured): full-size forward on vs off for (b),
# batch-1 step A/B per switch (one process each), W1 with LN_QUANT on / off.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/1_env.txt
timeout 90 python3 tools/check_decode_fusion.py --switch KESTREL_JAX_LN_QUANT --batches 1 8 \
  --out $OUT/x/1_check.json 2>&1 | grep -v "$FILT" > $OUT/x/1_check.log
tail -4 $OUT/x/1_check.log
for sw in TAU_DOTS LN_QUANT; do
  timeout 140 python3 tools/probe_step_kernels.py --kernels 30 --model md3 --kinds decode --batch 1 \
    --ab KESTREL_JAX_$sw=0,1 --json $OUT/x/1_probe.json 2>&1 | grep -v "$FILT" > $OUT/x/1_probe_$sw.log
  tail -22 $OUT/x/1_probe_$sw.log
done
EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
i=0
for s in 1 0; do
  i=$((i+1))
  KESTREL_JAX_LN_QUANT=$s timeout 110 python3 tools/benchmark.py --model md3 --random-weights --workloads w1 \
    --compile-cache /tmp/cc_$i --engine-args $EA --out $OUT/x/1_w1_${i}_lq$s.json 2>&1 | grep -v "$FILT" > $OUT/x/1_w1_${i}_lq$s.log
  echo "run $i ln_quant=$s: $(grep "batch-1 decode tok/s\|rror" $OUT/x/1_w1_${i}_lq$s.log | head -3 | tr '\n' ' ')"
done
cd $OUT && tar czf 1_all.tgz x && rm -rf x
