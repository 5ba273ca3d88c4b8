# Session 10, call 4: one MoE layer (FP8 experts, the engine's path) kernel by kernel, with its optimized HLO.
export PYTHONPATH=$PWD
timeout 300 python3 tools/probe_moe_kernels.py --tokens 1,740,1544 --out-dir $OUT 2>&1 | grep -v "cuda_event.cc\|cuda_stream.cc\|^$" > $OUT/4_probe.log
cat $OUT/4_probe.log | head -120
