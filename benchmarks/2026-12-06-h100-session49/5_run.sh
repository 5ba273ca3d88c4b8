# Session 49, call 5 (on call 4's machine, kept warm): does a deeper weight ring hide the in-kernel
# LayerNorm's latency? The rows kernel's ring depth with KESTREL_JAX_LN_IN_ROWS=1 at 8 (default),
# 16 and 22 stages. (Run as one command; the per-set JSON files' names had characters the device
# tool does not bring back: only the log and the default set's JSON came back.)
export PYTHONPATH=$PWD; mkdir -p $OUT; timeout 200 python3 tools/probe_step_kernels.py --kernels 45 --top 30 --model md3 --kinds decode --batch 1 --sets default KESTREL_JAX_LN_IN_ROWS=1 KESTREL_JAX_LN_IN_ROWS=1+KESTREL_JAX_GEMV_ROWS_STAGES=16 KESTREL_JAX_LN_IN_ROWS=1+KESTREL_JAX_GEMV_ROWS_STAGES=22 --json $OUT/5_probe_md3.json > $OUT/5_probe_md3.log 2>&1; grep "^\[.*\] decode:\|gemv_rows\|layer_norm_rows" $OUT/5_probe_md3.log | cut -c1-140
