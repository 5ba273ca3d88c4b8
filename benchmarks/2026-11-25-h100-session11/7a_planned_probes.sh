# Planned for the next GPU session (one call, ~9 min; if it runs out, split the decode half off):
# the three experiment switches landed in session 11, CPU-tested only, kernel by kernel
# (tools/probe_step_kernels.py --json, compared by tools/diff_step_kernels.py).
# - KESTREL_JAX_TAU_GELU=poly: MD3's tau GELU with the polynomial erf (XLA's exact-erf pass: 39.7 us
#   per MoE layer in the 2048-token prefill step, call 3; "loop_multiply_fusion" bf16[2048,6144]).
# - KESTREL_JAX_SPLIT_DENSE_GEMMS=1: dense layers' QKV and fc1 products kept apart in prefill steps
#   (XLA concatenated the two weights at run time: "wrapped_concatenate" bf16[2048,14336], 42 us per
#   dense layer per step; MD3 has 4 dense layers, MD2 24).
# - KESTREL_JAX_COMBINE_UNROLLED=1: the MoE combine reads the routing tables as [k, T] (the default
#   transposes them first: two transpose kernels per MoE layer per decode iteration, 2.9 us at 64
#   rows). Decode at 64 and at 1 row (W1 is bound by its kernel count).
export PYTHONPATH=$PWD
mkdir -p /tmp/p
P="timeout 110 python3 tools/probe_step_kernels.py --kernels 16"
$P --model md3 --kinds prefill --json /tmp/p/md3_pre_base.json > $OUT/1_probes.log 2>&1
KESTREL_JAX_TAU_GELU=poly $P --model md3 --kinds prefill --json /tmp/p/md3_pre_gelu.json >> $OUT/1_probes.log 2>&1
KESTREL_JAX_SPLIT_DENSE_GEMMS=1 $P --model md3 --kinds prefill --json /tmp/p/md3_pre_split.json >> $OUT/1_probes.log 2>&1
$P --model md2 --kinds prefill --json /tmp/p/md2_pre_base.json >> $OUT/1_probes.log 2>&1
KESTREL_JAX_SPLIT_DENSE_GEMMS=1 $P --model md2 --kinds prefill --json /tmp/p/md2_pre_split.json >> $OUT/1_probes.log 2>&1
for b in 64 1; do
  timeout 80 python3 tools/probe_step_kernels.py --model md3 --kinds decode --batch $b --json /tmp/p/dec${b}_base.json >> $OUT/1_probes.log 2>&1
  KESTREL_JAX_COMBINE_UNROLLED=1 timeout 80 python3 tools/probe_step_kernels.py --model md3 --kinds decode --batch $b --json /tmp/p/dec${b}_unrolled.json >> $OUT/1_probes.log 2>&1
done
tar -czf $OUT/1_probes.tar.gz -C /tmp/p .
D="python3 tools/diff_step_kernels.py --top 8"
for pair in md3_pre_base:md3_pre_gelu md3_pre_base:md3_pre_split md2_pre_base:md2_pre_split dec64_base:dec64_unrolled dec1_base:dec1_unrolled; do
  [ -f /tmp/p/${pair%%:*}.json ] && [ -f /tmp/p/${pair##*:}.json ] && $D /tmp/p/${pair%%:*}.json /tmp/p/${pair##*:}.json
done | tee $OUT/1_diffs.txt
