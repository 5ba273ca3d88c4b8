# Planned for the next GPU session (one call, ~9 min; if it runs out, split the decode half off): the two experiment switches landed in session
# 11, CPU-tested only, kernel by kernel (tools/probe_step_kernels.py names each fusion).
# - KESTREL_JAX_TAU_GELU=poly: MD3's tau GELU with the polynomial erf (XLA's exact-erf pass: 39.7 us
#   per MoE layer in the 2048-token prefill step, call 3; "loop_multiply_fusion" bf16[2048,6144]).
# - KESTREL_JAX_SPLIT_DENSE_GEMMS=1: dense layers' QKV and fc1 products kept apart in prefill steps
#   (XLA concatenated the two weights at run time: "wrapped_concatenate" bf16[2048,14336], 42 us per
#   dense layer per step; MD3 has 4 dense layers, MD2 24).
# - KESTREL_JAX_COMBINE_UNROLLED=1: the MoE combine reads the routing tables as [k, T] (the default
#   transposes them first: two transpose kernels per MoE layer per decode iteration, 2.9 us at 64
#   rows; at batch 1 they are 2 of the token's ~335 kernels per layer pair). Decode at 64 and 1 rows.
export PYTHONPATH=$PWD
P="python3 tools/probe_step_kernels.py --kinds prefill --kernels 16"
timeout 110 $P --model md3 > $OUT/1_md3_base.log 2>&1
KESTREL_JAX_TAU_GELU=poly KESTREL_JAX_SPLIT_DENSE_GEMMS=1 timeout 110 $P --model md3 > $OUT/1_md3_both.log 2>&1
timeout 110 $P --model md2 > $OUT/1_md2_base.log 2>&1
KESTREL_JAX_SPLIT_DENSE_GEMMS=1 timeout 110 $P --model md2 > $OUT/1_md2_split.log 2>&1
D="python3 tools/probe_step_kernels.py --model md3 --kinds decode --kernels 30"
timeout 80 $D --batch 64 > $OUT/2_dec64_base.log 2>&1
KESTREL_JAX_COMBINE_UNROLLED=1 timeout 80 $D --batch 64 > $OUT/2_dec64_unrolled.log 2>&1
timeout 80 $D --batch 1 > $OUT/2_dec1_base.log 2>&1
KESTREL_JAX_COMBINE_UNROLLED=1 timeout 80 $D --batch 1 > $OUT/2_dec1_unrolled.log 2>&1
grep -h "^decode:" $OUT/2_*.log
for f in $OUT/1_*.log; do echo "== $f"; grep -A18 "^prefill:" $f | grep -v "^   .*x1 " | head -20; grep -A17 "kernels by time" $f; done
