# Session 12, call 6: W2 C=64 A/B/A (MD2: A/B) of KESTREL_JAX_QUANT_KERNEL (call 5: decode step -203 us, prefill step -378 us)
# with the defaults of commit 71b2f03 (tau GELU poly, dense split). MD3 only (MD2 has no MoE layers): A/B/A/B.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
EA="decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1"
for m in md3; do
  runs="off on off2 on2"
  for run in $runs; do
    if [ ${run%2} = on ]; then export KESTREL_JAX_QUANT_KERNEL=1; else export KESTREL_JAX_QUANT_KERNEL=0; fi
    echo "### $m $run" >> $OUT/6_w2.log
    timeout 135 python3 tools/benchmark.py --model $m --random-weights --requests-per-client 16 --concurrency 64 --workloads w2 --compile-cache /tmp/cc_$m --engine-args $EA --out $OUT/6_${m}_$run.json 2>&1 | grep -v "$FILT" >> $OUT/6_w2.log
  done
done
grep -h "###\|engine ready\|w2 C=\|rror" $OUT/6_w2.log | cut -c1-300
