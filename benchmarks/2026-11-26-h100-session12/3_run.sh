# Session 12, call 3 (session 11 7b_planned_w2.sh): after the probes (calls 1-2), W2 C=64 A/B/A (MD2: A/B) of whichever switch
# 7a showed faster (here both, together), MD3 then MD2 (MD2 has 24 dense layers).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
EA="decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1"
for m in md3 md2; do
  runs="off on off2"; [ $m = md2 ] && runs="off on"  # (cold compiles ~100-115 s each: fit 600 s)
  for run in $runs; do
    if [ $run = on ]; then export KESTREL_JAX_TAU_GELU=poly KESTREL_JAX_SPLIT_DENSE_GEMMS=1; else unset KESTREL_JAX_TAU_GELU KESTREL_JAX_SPLIT_DENSE_GEMMS; fi
    echo "### $m $run" >> $OUT/3_w2.log
    timeout 135 python3 tools/benchmark.py --model $m --random-weights --requests-per-client 8 --concurrency 64 --workloads w2 --compile-cache /tmp/cc_$m --engine-args $EA --out $OUT/3_${m}_$run.json 2>&1 | grep -v "$FILT" >> $OUT/3_w2.log
  done
done
grep -h "###\|engine ready\|w2 C=\|rror" $OUT/3_w2.log | cut -c1-300
