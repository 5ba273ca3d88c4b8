# Session 43, call 2 (H200): the opt-in KESTREL_JAX_DENSE_DECODE_LN=1 (a dense block's decode
# LayerNorm in layer_norm_blocks' one Pallas launch instead of XLA's two; built and CPU-tested in
# the forty-second session, never timed). First MD2's 64-row decode step kernel by kernel, 0 then 1
# in turn in one process (probe_step_kernels --ab); then MD2 W2 at C=64 (the issue 6 arguments),
# alternating 0 1 0 1 0 1 in separate processes over one compile cache per setting (the first of
# each compiles).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/2_env.txt
timeout 170 python3 tools/probe_step_kernels.py --kernels 30 --top 30 --model md2 --kinds decode --batch 64 \
  --ab KESTREL_JAX_DENSE_DECODE_LN=0,1 --json $OUT/x/2_probe.json 2>&1 | grep -v "$FILT" > $OUT/x/2_probe.log
echo "probe rc $? ($SECONDS s)"
grep -i "diff\|total\|sum\|wall\|layer_norm\|^  [+-]" $OUT/x/2_probe.log | cut -c1-200 | head -40
W2ARGS="--concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
i=0
for ln in 0 1 0 1 0 1; do
  i=$((i + 1))
  [ $SECONDS -gt 500 ] && { echo "skip run $i (ln=$ln): $SECONDS s"; continue; }
  KESTREL_JAX_DENSE_DECODE_LN=$ln timeout $((585 - SECONDS)) python3 tools/benchmark.py --model md2 --random-weights \
    --compile-cache /tmp/cc_md2_ln$ln --workloads w2 $W2ARGS --out $OUT/x/2_md2_${i}_ln$ln.json 2>&1 \
    | grep -v "$FILT" > $OUT/x/2_md2_${i}_ln$ln.log
  echo "md2 run $i ln=$ln ($SECONDS s): $(grep "w2 C=64\|rror" $OUT/x/2_md2_${i}_ln$ln.log | cut -c1-120 | tr '\n' ' ')"
done
cd $OUT && gzip x/2_md2*.json; tar czf 2_all.tgz x && rm -rf x
