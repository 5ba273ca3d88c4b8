# Session 17, call 4: the LayerNorm kernel with an optimization barrier on the residual it reads
# (call 3's HLO: without it XLA recomputed earlier layers' residual adds inside each layer's residual
# fusion, +1.5 us each). Batch-1 step probe off/on, then W1 on/off/on.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
P="timeout 80 python3 tools/probe_step_kernels.py --kernels 20 --model md3 --kinds decode --batch 1"
mkdir -p /tmp/pd
KESTREL_JAX_LN_KERNEL=0 $P --json /tmp/pd/off.json > $OUT/4_probe_off.log 2>&1
$P --json /tmp/pd/on.json > $OUT/4_probe_on.log 2>&1
python3 tools/diff_step_kernels.py --top 12 /tmp/pd/off.json /tmp/pd/on.json > $OUT/4_diffs.txt 2>&1
EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
for run in on off on2; do
  if [ $run = off ]; then export KESTREL_JAX_LN_KERNEL=0; else unset KESTREL_JAX_LN_KERNEL; fi
  echo "### $run" >> $OUT/4_w1.log
  timeout 110 python3 tools/benchmark.py --model md3 --random-weights --workloads w1 --compile-cache /tmp/cc_$run \
    --engine-args $EA --out /tmp/4_w1_$run.json 2>&1 | grep -v "$FILT" >> $OUT/4_w1.log
done
cat $OUT/4_diffs.txt; grep -h "###\|w1:\|rror" $OUT/4_w1.log | cut -c1-200
