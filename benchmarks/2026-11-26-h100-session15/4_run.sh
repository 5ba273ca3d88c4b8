# Session 15, call 4: the decode attention split count at small batches. (a) Call times (kernel +
# split merge + the wrapper's copies) by split count at B=1, 2, 4 and KV 740-1250
# (bench_attention.py --splits-sweep; "default" = the new rule: at most one CTA per SM). (b) MD3 W1
# (batch-1 decode) with the old rule (~2 CTAs per SM: 8 splits at B=1), the new one (4) and 2.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
timeout 150 python3 tools/bench_attention.py --splits-sweep --budget-s 110 --out $OUT/4_splits.json 2>&1 | grep -v "$FILT" > $OUT/4_splits.log
EA="decode_buckets=1 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
for v in old new 2 old new; do
  s=$v; [ $v = new ] && s=
  KESTREL_JAX_DECODE_SPLITS=$s timeout 140 python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc4_$v \
    --workloads w1 --engine-args $EA --out $OUT/4_w1_$v.json 2>&1 | grep -v "$FILT" | grep "w1:\|rror" | cut -c1-150 | sed "s/^/$v /" >> $OUT/4_w1.log
done
grep "^decode" $OUT/4_splits.log | cut -c1-420; cat $OUT/4_w1.log
