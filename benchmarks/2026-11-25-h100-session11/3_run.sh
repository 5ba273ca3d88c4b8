# Session 11, call 3: the step probe again after its fix (call 2's probe baked the weights into the
# program as constants and timed out): prefill (2 x 740 tokens, bucket 2048), mixed (+64 decode
# rows), decode (64 rows at position 800), vision (one crop) kernel by kernel with their HLO; then the
# MoE layer alone at T = 740 and 1544 (FP8, kernel by kernel).
export PYTHONPATH=$PWD
timeout 330 python3 tools/probe_step_kernels.py --model md3 --kinds prefill,mixed,decode,vision --top 60 --out-dir $OUT > $OUT/3_steps.log 2>&1
timeout 120 python3 tools/probe_moe_kernels.py --tokens 740,1544 > $OUT/3_moe.log 2>&1
grep -v "^   " $OUT/3_steps.log | tail -6; grep "^T=" $OUT/3_moe.log
