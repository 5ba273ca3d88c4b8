# Session 12, call 5: new A/B switches, kernel by kernel (tools/probe_step_kernels.py --json, diffed):
# - KESTREL_JAX_QUANT_KERNEL=1: the W8A8 token and activation rows quantised by one Triton pass
#   (decode at 64 rows: XLA took 3 kernels, 11.3 us per MoE layer for the activation; prefill
#   2 x 740 tokens: 32.9 us per layer).
# - KESTREL_JAX_GEMV_QKV_ROWS / _PROJ_ROWS: the decode GEMM kernel for the MoE layers' attention
#   projections above 1 / 8 rows (XLA's QKV GEMM at 64 rows: 13.8 us, ~1.8 TB/s; proj 7.0 us).
export PYTHONPATH=$PWD
mkdir -p /tmp/p
P="timeout 100 python3 tools/probe_step_kernels.py --kernels 12 --model md3"
$P --kinds decode --batch 64 --json /tmp/p/d64_base.json > $OUT/5_probes.log 2>&1
KESTREL_JAX_QUANT_KERNEL=1 $P --kinds decode --batch 64 --json /tmp/p/d64_quant.json >> $OUT/5_probes.log 2>&1
KESTREL_JAX_GEMV_QKV_ROWS=64 KESTREL_JAX_GEMV_PROJ_ROWS=64 $P --kinds decode --batch 64 --json /tmp/p/d64_gemv.json >> $OUT/5_probes.log 2>&1
$P --kinds decode --batch 16 --json /tmp/p/d16_base.json >> $OUT/5_probes.log 2>&1
KESTREL_JAX_GEMV_QKV_ROWS=16 KESTREL_JAX_GEMV_PROJ_ROWS=16 $P --kinds decode --batch 16 --json /tmp/p/d16_gemv.json >> $OUT/5_probes.log 2>&1
$P --kinds prefill --json /tmp/p/pre_base.json >> $OUT/5_probes.log 2>&1
KESTREL_JAX_QUANT_KERNEL=1 $P --kinds prefill --json /tmp/p/pre_quant.json >> $OUT/5_probes.log 2>&1
tar -czf $OUT/5_probes.tar.gz -C /tmp/p .
D="python3 tools/diff_step_kernels.py --top 8"
for pair in d64_base:d64_quant d64_base:d64_gemv d16_base:d16_gemv pre_base:pre_quant; do
  [ -f /tmp/p/${pair%%:*}.json ] && [ -f /tmp/p/${pair##*:}.json ] && $D /tmp/p/${pair%%:*}.json /tmp/p/${pair##*:}.json
done | tee $OUT/5_diffs.txt
grep -h "rror" $OUT/5_probes.log | head
