# Session 12, call 8: KESTREL_JAX_TAU_FACTORS=1 (the decode QKV epilogue kernel past 8 rows, XLA
# forming MD3's tau factors), decode step probes at 64 and 16 rows, then W2 C=64 A/B/A/B.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
mkdir -p /tmp/p
P="timeout 100 python3 tools/probe_step_kernels.py --kernels 12 --model md3 --kinds decode"
for b in 64 16; do
  $P --batch $b --json /tmp/p/d${b}_base.json >> $OUT/8_probes.log 2>&1
  KESTREL_JAX_TAU_FACTORS=1 $P --batch $b --json /tmp/p/d${b}_tf.json >> $OUT/8_probes.log 2>&1
  python3 tools/diff_step_kernels.py --top 12 /tmp/p/d${b}_base.json /tmp/p/d${b}_tf.json | tee -a $OUT/8_diffs.txt
done
tar -czf $OUT/8_probes.tar.gz -C /tmp/p .
EA="decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1"
for run in off on off2 on2; do
  if [ ${run%2} = on ]; then export KESTREL_JAX_TAU_FACTORS=1; else export KESTREL_JAX_TAU_FACTORS=0; fi
  echo "### md3 $run" >> $OUT/8_w2.log
  timeout 130 python3 tools/benchmark.py --model md3 --random-weights --requests-per-client 16 --concurrency 64 --workloads w2 --compile-cache /tmp/cc --engine-args $EA --out $OUT/8_w2_$run.json 2>&1 | grep -v "$FILT" >> $OUT/8_w2.log
done
grep -h "###\|engine ready\|w2 C=\|rror" $OUT/8_w2.log | cut -c1-250
