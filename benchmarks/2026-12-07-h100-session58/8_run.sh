# Prepared in session 57 (2026-12-07) for any H100 / H200 (~9 device minutes; move it into the session's
# dated folder first). The MD3 MoE layers' QKV + router rows kernel streams its 25.4 MB with 97 CTAs (one per
# 64 of its 6,208 columns), leaving 35 of 132 SMs idle, at ~20 GB/s per CTA: 0.65 of the read figure
# without the residual, 0.59-0.61 with it (session 57). Does the pair stream faster spread over more CTAs?
# (1) the rows kernel alone (md3_plain, 97 CTAs) against the split decode GEMM's row-0 partials in 2 and 4 K
# ranges (194 / 388 CTAs) and against the rows kernel in clusters of 2 CTAs splitting K (`gemv_rows(k_split=2)`,
# new, `_k2` cases), with the LayerNorm, tau dots and residual (md3_k2, md3_res_k2 / _k4) as the step runs
# it; (2) GPU check of KESTREL_JAX_ROWS_K_SPLIT=2 against 1 (MD3, one row, 6 layers: the first MoE layer is
# layer 4, the first with the MoE residual inside layer 5); (3) MD3 W1, the default against
# KESTREL_JAX_ROWS_K_SPLIT=2 (and 4 if time is left), each run its own process and compile cache. Make 2 the
# default only if (1), (2) and (3) all say so.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/8_env.txt
timeout 170 python3 tools/bench_rows_kernel.py --layers 16 --rounds 2 --budget-s 130 \
  --cases md3_plain,md3_plain_k2,md3_split2,md3_split4,md3_res,md3_res_k2,md3_res_k4,md3,md3_k2,md2,md2_k2,md2_k2_st4 \
  --out $OUT/8_rows.json 2>&1 | grep -v "$FILT" > $OUT/8_rows.log
grep "^{" $OUT/8_rows.log | cut -c1-220
timeout 120 python3 tools/check_decode_fusion.py --model md3 --switch KESTREL_JAX_ROWS_K_SPLIT=2,1 --batches 1 \
  --layers 6 --out $OUT/8_check.json 2>&1 | grep -v "$FILT" > $OUT/8_check.log
tail -4 $OUT/8_check.log
A="--random-weights --workloads w1 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
for s in 1 2 4; do
  [ $SECONDS -gt 440 ] && break
  KESTREL_JAX_ROWS_K_SPLIT=$s timeout $((590 - SECONDS)) python3 tools/benchmark.py --model md3 $A \
    --compile-cache /tmp/cc_md3_k$s --out $OUT/8_w1_md3_k${s}_$SECONDS.json > /tmp/w1.log 2>&1
  echo "md3 rows k_split $s ($SECONDS s): $(grep -o 'w1: .*of copy)' /tmp/w1.log)" | tee -a $OUT/8_w1.txt
  grep -i "error" /tmp/w1.log | head -3
done
