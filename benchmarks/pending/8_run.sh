# Prepared in session 57 (2026-12-07) for any H100 / H200 (~3 device minutes; move it into the session's
# dated folder first). The MD3 MoE layers' QKV + router rows kernel streams its 25.4 MB with 97 CTAs (one per
# 64 of its 6,208 columns), leaving 35 of 132 SMs idle, at ~20 GB/s per CTA: 0.65 of the read figure
# without the residual, 0.59-0.61 with it (session 57). Does the pair stream faster spread over more CTAs?
# The rows kernel alone (md3_plain, 97 CTAs) against the split decode GEMM's row-0 partials in 2 and 4 K
# ranges (194 / 388 CTAs), beside whole-wave plain rows (132 CTAs) and the engine's two cases. If split2
# beats md3_plain by well over 1 us, a rows kernel whose CTA pairs split K and sum through a cluster is worth
# building (the LayerNorm, tau dots and residual would stay per CTA as now).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/8_env.txt
timeout 170 python3 tools/bench_rows_kernel.py --layers 16 --rounds 2 --budget-s 130 \
  --cases md3_plain,md3_split2,md3_split4,plain_132,md3,md3_res \
  --out $OUT/8_rows.json 2>&1 | grep -v "$FILT" > $OUT/8_rows.log
grep "^{" $OUT/8_rows.log | cut -c1-220
