# Session 17, call 1: the decode GEMM's rows kernel (`gemv_mgpu.gemv_rows`, KESTREL_JAX_GEMV_ROWS):
# an MoE layer's QKV and router products as finished bf16 rows (one CTA per 64 columns, no split
# sum), read by the QKV epilogue and routing-table kernels as they are; removes XLA's two split-sum
# launches per MoE layer. Kernel timing (cold weights), then W1 on/off, then the batch-1 step probe.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > $OUT/1_env.txt
for f in $(python3 -c "import jax_plugins, os; print(os.path.dirname(jax_plugins.__path__[0]))" 2>/dev/null)/jax_plugins/*/*.so; do
  echo "$f: uses_pdl strings $(strings $f | grep -c uses_pdl)" >> $OUT/1_env.txt; done
timeout 150 python3 tools/bench_decode_gemm.py --shapes qkv_router,proj --rows 1 8 --layers 24 --iters 10 \
  --variants default,gemv,gemv_rows,gemv_rows_st8,gemv_rows_st24 --budget-s 110 --out $OUT/1_gemm.json 2>&1 | grep -v "$FILT" > $OUT/1_gemm.log
EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
for run in rows pair; do
  if [ $run = pair ]; then export KESTREL_JAX_GEMV_ROWS=0; else unset KESTREL_JAX_GEMV_ROWS; fi
  echo "### $run" >> $OUT/1_w1.log
  timeout 130 python3 tools/benchmark.py --model md3 --random-weights --workloads w1 --compile-cache /tmp/cc_$run \
    --engine-args $EA --out $OUT/1_w1_$run.json 2>&1 | grep -v "$FILT" >> $OUT/1_w1.log
done
unset KESTREL_JAX_GEMV_ROWS
mkdir -p /tmp/p
P="timeout 90 python3 tools/probe_step_kernels.py --kernels 12 --model md3 --kinds decode --batch 1"
$P --json /tmp/p/d1_rows.json > $OUT/1_probes.log 2>&1
KESTREL_JAX_GEMV_ROWS=0 $P --json /tmp/p/d1_pair.json >> $OUT/1_probes.log 2>&1
python3 tools/diff_step_kernels.py --top 12 /tmp/p/d1_pair.json /tmp/p/d1_rows.json > $OUT/1_diffs.txt 2>&1
cat $OUT/1_env.txt; cat $OUT/1_gemm.log | cut -c1-160; grep -h "###\|engine ready\|w1:\|rror" $OUT/1_w1.log | cut -c1-250; cat $OUT/1_diffs.txt | head -40
