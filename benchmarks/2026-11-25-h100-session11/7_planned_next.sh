# Planned for the next GPU session, not run here (device time spent).
# 1. The tau GELU (39.7 us per MoE layer in the 2048-token prefill step, call 3): XLA's exact erf
#    against the polynomial erf (KESTREL_JAX_TAU_GELU=poly, landed this session, CPU-tested only),
#    kernel by kernel (the step probe names the GELU fusion), then W2 A/B in one call.
# 2. The default bucket set's cold and warm start-up (call 6 ran out of device time after 225 s),
#    equal num_pages across processes, then W1 and W2 C=64/32/8 with every default.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
# 1b. KESTREL_JAX_SPLIT_DENSE_GEMMS=1 (landed this session, CPU-tested only): the dense layers' QKV and
#    fc1 products kept apart in prefill steps; XLA's dot merger concatenated the two weights at run
#    time (wrapped_concatenate bf16[2048,14336], 42 us per dense layer per prefill step, call 3).
#    MD3 has 4 dense layers, MD2 24: probe both models' prefill steps, then MD2 W2 A/B.
for g in xla poly; do
  KESTREL_JAX_TAU_GELU=$g timeout 150 python3 tools/probe_step_kernels.py --model md3 --kinds prefill,decode > $OUT/1_steps_$g.log 2>&1
done
for m in md3 md2; do
  KESTREL_JAX_SPLIT_DENSE_GEMMS=1 timeout 150 python3 tools/probe_step_kernels.py --model $m --kinds prefill --kernels 12 > $OUT/1_split_$m.log 2>&1
done
[ -f $OUT/1_steps_xla.log ] && grep -h "^prefill" $OUT/1_steps_xla.log $OUT/1_split_md3.log
ARGS="--model md3 --random-weights --requests-per-client 8 --concurrency 64 --workloads w2 --compile-cache /tmp/cc"
EA="decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1"
for g in xla poly xla; do
  echo "### tau gelu $g" >> $OUT/1_w2.log
  KESTREL_JAX_TAU_GELU=$g timeout 150 python3 tools/benchmark.py $ARGS --engine-args $EA --out $OUT/1_w2_$g.json 2>&1 | grep -v "$FILT" >> $OUT/1_w2.log
done
grep -h "^prefill\|^decode\|multiply" $OUT/1_steps_*.log | head -20; grep -h "###\|w2 C=" $OUT/1_w2.log | cut -c1-300
# second call: the defaults
rm -rf /tmp/cc
timeout 420 python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc --workloads startup,w1,w2 --concurrency 64 32 8 --out $OUT/2_md3.json 2>&1 | grep -v "$FILT" > $OUT/2_md3.log
timeout 90 python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc --workloads startup --out $OUT/2_md3_warm.json 2>&1 | grep -v "$FILT" > $OUT/2_md3_warm.log
grep -h "engine ready\|num_pages\|w1:\|w2 C=\|rror" $OUT/2_*.log | cut -c1-600
