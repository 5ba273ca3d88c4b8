# Session 17, call 2: the decode MoE layer's LayerNorm as one Triton launch with both copies its
# kernels read (`layer_norm_triton`, KESTREL_JAX_LN_KERNEL), checked on the GPU with the rows kernel
# (full-size forward, switch on vs off), W1 A/B/A; the rows kernel's ring depth and the routing
# program's warps as kernel timings; the batch-1 step probe with its HLO.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
timeout 100 python3 tools/check_decode_fusion.py --switch KESTREL_JAX_LN_KERNEL KESTREL_JAX_GEMV_ROWS --batches 1 \
  --out $OUT/2_check.json 2>&1 | grep -v "$FILT" > $OUT/2_check.log
timeout 40 python3 tools/bench_route_tables.py --warps 1 2 4 8 --rows 1 8 --out $OUT/2_route.json 2>&1 | grep -v "$FILT" > $OUT/2_route.log
timeout 90 python3 tools/bench_decode_gemm.py --shapes qkv_router --rows 1 --layers 24 --iters 10 \
  --variants gemv,gemv_rows_st4,gemv_rows_st6,gemv_rows,gemv_rows_st12 --budget-s 70 --out $OUT/2_gemm.json 2>&1 | grep -v "$FILT" > $OUT/2_gemm.log
EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
for run in ln xla ln2; do
  if [ $run = xla ]; then export KESTREL_JAX_LN_KERNEL=0; else unset KESTREL_JAX_LN_KERNEL; fi
  echo "### $run" >> $OUT/2_w1.log
  timeout 110 python3 tools/benchmark.py --model md3 --random-weights --workloads w1 --compile-cache /tmp/cc_$run \
    --engine-args $EA --out $OUT/2_w1_$run.json 2>&1 | grep -v "$FILT" >> $OUT/2_w1.log
done
unset KESTREL_JAX_LN_KERNEL
timeout 80 python3 tools/probe_step_kernels.py --kernels 40 --model md3 --kinds decode --batch 1 --out-dir /tmp/pd \
  > $OUT/2_probe.log 2>&1
cp /tmp/pd/*decode*hlo* $OUT/ 2>/dev/null
cat $OUT/2_check.log $OUT/2_route.log; cut -c1-150 $OUT/2_gemm.log; grep -h "###\|w1:\|rror" $OUT/2_w1.log | cut -c1-200; head -30 $OUT/2_probe.log
