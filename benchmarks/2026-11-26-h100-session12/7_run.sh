# Session 12, call 7: W8A8 from 1 token (KESTREL_JAX_W8A8_MIN_TOKENS=1, default 4) now that the
# activation quantisation is one kernel per pass (the fourth session's W8A16 win at T=1 was
# 1.2 us per layer, lost to XLA's quantisation passes). Batch-1 decode step probe, then W1 A/B/A.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
mkdir -p /tmp/p
P="timeout 100 python3 tools/probe_step_kernels.py --kernels 12 --model md3 --kinds decode --batch 1"
$P --json /tmp/p/d1_base.json > $OUT/7_probes.log 2>&1
KESTREL_JAX_W8A8_MIN_TOKENS=1 $P --json /tmp/p/d1_w8a8.json >> $OUT/7_probes.log 2>&1
python3 tools/diff_step_kernels.py --top 10 /tmp/p/d1_base.json /tmp/p/d1_w8a8.json | tee $OUT/7_diffs.txt
tar -czf $OUT/7_probes.tar.gz -C /tmp/p .
EA="decode_buckets=1 prefill_token_buckets=1024 runner.vision_buckets=1"
for run in base w8a8 base2; do
  if [ $run = w8a8 ]; then export KESTREL_JAX_W8A8_MIN_TOKENS=1; else unset KESTREL_JAX_W8A8_MIN_TOKENS; fi
  echo "### $run" >> $OUT/7_w1.log
  timeout 120 python3 tools/benchmark.py --model md3 --random-weights --workloads w1 --compile-cache /tmp/cc --engine-args $EA --out $OUT/7_w1_$run.json 2>&1 | grep -v "$FILT" >> $OUT/7_w1.log
done
grep -h "###\|engine ready\|w1:\|rror" $OUT/7_w1.log | cut -c1-250
