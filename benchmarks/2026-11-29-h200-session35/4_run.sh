# Session 35, call 4 (H200): call 3 showed cuBLAS running MD2's merged decode QKV + fc1 product at
# 64 rows in 19.1 us against XLA's Triton GEMM's 22.5, but only after a 33 us run-time weight
# concatenation (XLA's dot merger joins the two products; Triton fuses the join, cuBLAS cannot).
# Now the weights are joined once at load (RunnerConfig.fused_dense_decode, new, "auto" = on a GPU).
# (1) MD2 decode step at 64 and 1 rows, joined off / on (one process each); (2) MD2 W2 C=64 off / on /
# off / on (each its own compile cache); (3) MD2 W1 off / on if time is left.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/4_env.txt
for b in 64 1; do for f in off on; do
  timeout 100 python3 tools/probe_step_kernels.py --kernels 40 --top 30 --model md2 --kinds decode --fused-dense-decode $f \
    --batch $b --context 800 --wall-rounds 3 --json $OUT/x/4_probe_b${b}_$f.json 2>&1 | grep -v "$FILT" > $OUT/x/4_probe_b${b}_$f.log
  echo "probe b$b fused $f ($SECONDS s): $(grep "launches (\|rror" $OUT/x/4_probe_b${b}_$f.log | cut -c1-160)"
done; done
W2="--concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1"
i=0
for f in off on off on; do
  i=$((i+1))
  [ $SECONDS -gt 480 ] && { echo "skip run $i ($f): $SECONDS s"; continue; }
  timeout $((590 - SECONDS)) python3 tools/benchmark.py --model md2 --random-weights \
    --compile-cache /tmp/cc_md2_$f --workloads w2 $W2 runner.fused_dense_decode=$f --out $OUT/x/4_${i}_md2_$f.json 2>&1 \
    | grep -v "$FILT" > $OUT/x/4_${i}_md2_$f.log
  echo "run $i fused=$f ($SECONDS s): $(grep "w2 C=64\|rror" $OUT/x/4_${i}_md2_$f.log | cut -c1-150 | head -2 | tr '\n' ' ')"
done
cd $OUT && gzip x/4_*_md2_*.json; tar czf 4_all.tgz x && rm -rf x
