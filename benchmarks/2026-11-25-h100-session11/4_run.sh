# (The tau-products kernel this call measured is in commit 667cbb3, reverted in the next commit.)
# Session 11, call 4: the MD3 tau products as one Pallas Triton kernel (kestrel_jax/pallas/tau_dots.py):
# configs swept against the XLA path at T = 16, 64, 740, 2048; then W2 MD3 C=64 with the kernel (on)
# and without (KESTREL_JAX_TAU_DOTS_KERNEL=0), same settings otherwise.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
timeout 170 python3 tools/bench_tau_dots.py --rows 16,64,740,2048 --iters 10 --out $OUT/4_tau_dots.json > $OUT/4_tau_dots.log 2>&1
ARGS="--model md3 --random-weights --requests-per-client 8 --concurrency 64 --workloads w2 --compile-cache /tmp/cc"
EA="decode_buckets=1,64 prefill_token_buckets=2048 runner.vision_buckets=1"
for run in on:1 off:0; do
  name=${run%%:*}; flag=${run##*:}
  echo "### tau kernel $name" >> $OUT/4_w2.log
  KESTREL_JAX_TAU_DOTS_KERNEL=$flag timeout 150 python3 tools/benchmark.py $ARGS --engine-args $EA --out $OUT/4_$name.json 2>&1 | grep -v "$FILT" >> $OUT/4_w2.log
done
grep -v "^   [ 0-9]" $OUT/4_tau_dots.log | head -30; grep -A6 "^T=" $OUT/4_tau_dots.log | head -40; grep -h "###\|engine ready\|w2 C=\|rror" $OUT/4_w2.log | cut -c1-300
