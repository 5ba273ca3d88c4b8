# Prepared in session 54 (2026-12-06), which had too little device time left to start a machine for it
# (any H100 / H200, ~4 device minutes; move it into the session's dated folder first): the opt-in
# KESTREL_JAX_MOE_RESIDUAL_IN_ROWS=1 (an MoE layer's residual add inside the next MoE layer's QKV +
# router rows kernel: the down GEMM writes the projection's row-0 partials, the rows kernel gathers
# the token's 8 expert rows). MD3 forward on against off (one step, all layers), then the MD3
# batch-1 probe A/B.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/4_env.txt
timeout 70 python3 tools/check_decode_fusion.py --model md3 --switch KESTREL_JAX_MOE_RESIDUAL_IN_ROWS --batches 1 \
  2>&1 | grep -v "$FILT" > $OUT/4_check_fusion_md3.log
echo "check ($SECONDS s):"; grep "switch\|rror" $OUT/4_check_fusion_md3.log | cut -c1-250
timeout $((200 - SECONDS)) python3 tools/probe_step_kernels.py --kernels 45 --top 30 --model md3 --kinds decode \
  --batch 1 --sets default KESTREL_JAX_MOE_RESIDUAL_IN_ROWS=1 --json $OUT/4_probe_md3.json 2>&1 \
  | grep -v "$FILT" > $OUT/4_probe_md3.log
echo "probe md3 ($SECONDS s):"; grep "^\[.*\] decode:\|rror\|gemv_rows\|loop_add\|^decode:\|moe\|  [-+]" $OUT/4_probe_md3.log | cut -c1-150
