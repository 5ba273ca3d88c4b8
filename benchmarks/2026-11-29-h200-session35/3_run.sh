# Session 35, call 3 (H200): (1) MD2 decode step at 64 rows with XLA's Triton GEMMs off
# (--xla_gpu_enable_triton_gemm=false: cuBLAS for the dense layers' QKV + fc1, projection and fc2
# products, which run at 40-70% of copy at 64 rows), each its own process; (2) MD2 W2 C=64 with the
# residual + LayerNorm kernel off / on / off / on / off / on (KESTREL_JAX_BLOCK_LN; each setting its own
# compile cache: runs 1-2 cold, the rest warm), W2 settings as sessions 32-34; rows per program now
# 1 at the vision width and 2 at the text width (call 2's bench).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/3_env.txt
for t in on off; do
  F=""; [ $t = off ] && F="--xla_gpu_enable_triton_gemm=false"
  XLA_FLAGS="$F" timeout 100 python3 tools/probe_step_kernels.py --kernels 40 --top 30 --model md2 --kinds decode \
    --batch 64 --context 800 --wall-rounds 3 --json $OUT/x/3_probe_triton_$t.json 2>&1 | grep -v "$FILT" > $OUT/x/3_probe_triton_$t.log
  echo "probe triton gemm $t ($SECONDS s): $(grep "launches (\|rror" $OUT/x/3_probe_triton_$t.log | cut -c1-160)"
done
W2="--concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1"
i=0
for v in 0 1 0 1 0 1; do
  i=$((i+1))
  [ $SECONDS -gt 520 ] && { echo "skip run $i ($v): $SECONDS s"; continue; }
  KESTREL_JAX_BLOCK_LN=$v timeout $((590 - SECONDS)) python3 tools/benchmark.py --model md2 --random-weights \
    --compile-cache /tmp/cc_md2_$v --workloads w2 $W2 --out $OUT/x/3_${i}_md2_ln$v.json 2>&1 | grep -v "$FILT" > $OUT/x/3_${i}_md2_ln$v.log
  echo "run $i ln=$v ($SECONDS s): $(grep "w2 C=64\|rror" $OUT/x/3_${i}_md2_ln$v.log | cut -c1-150 | head -2 | tr '\n' ' ')"
done
cd $OUT && gzip x/*_md2_ln*.json; tar czf 3_all.tgz x && rm -rf x
