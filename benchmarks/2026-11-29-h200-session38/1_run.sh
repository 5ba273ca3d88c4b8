# Session 38, call 1 (H200): MD2's dense fc1 with the tanh GELU in its epilogue
# (dense_mgpu.linear_gelu, new; ops.linear_gelu, on by default on a GPU at >= 256 rows) against
# XLA's cuBLAS GEMM + GELU pass. (1) bench_linear_gelu: the kernel alone at MD2 prefill / mixed
# shapes and the vision encoder's (N padded), four tile/stage configs, checked against XLA;
# (2) the MD2 mixed and prefill steps, on / off in one probe process; (3) MD2 W2 C=64 on / off
# alternated (own compile caches) as time allows.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/1_env.txt
timeout 150 python3 tools/bench_linear_gelu.py --variants 128x2 128x3 64x3 64x4 --out $OUT/x/1_bench.json 2>&1 \
  | grep -v "$FILT" > $OUT/x/1_bench.log
echo "bench ($SECONDS s):"; cut -c1-160 $OUT/x/1_bench.log | head -40
timeout 170 python3 tools/probe_step_kernels.py --kernels 30 --top 30 --model md2 --kinds mixed,prefill \
  --tokens 1536 --batch 64 --context 800 --wall-rounds 3 --sets default KESTREL_JAX_LINEAR_GELU=0 \
  --json $OUT/x/1_probe.json 2>&1 | grep -v "$FILT" > $OUT/x/1_probe.log
echo "probe ($SECONDS s):"; grep "launches (\|rror" $OUT/x/1_probe.log | cut -c1-200
W2="--concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1"
i=0
for f in on off on off; do
  i=$((i+1))
  [ $SECONDS -gt 480 ] && { echo "skip run $i ($f): $SECONDS s"; continue; }
  if [ $f = off ]; then E="env KESTREL_JAX_LINEAR_GELU=0"; else E=env; fi
  timeout $((585 - SECONDS)) $E python3 tools/benchmark.py --model md2 --random-weights \
    --compile-cache /tmp/cc_md2_$f --workloads w2 $W2 --out $OUT/x/1_${i}_md2_$f.json 2>&1 \
    | grep -v "$FILT" > $OUT/x/1_${i}_md2_$f.log
  echo "run $i $f ($SECONDS s): $(grep "w2 C=64\|rror" $OUT/x/1_${i}_md2_$f.log | cut -c1-150 | head -2 | tr '\n' ' ')"
done
cd $OUT && gzip x/1_*_md2_*.json x/1_probe.json 2>/dev/null; tar czf 1_all.tgz x && rm -rf x
