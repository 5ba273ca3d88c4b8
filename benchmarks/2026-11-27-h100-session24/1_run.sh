# Session 24, call 1: GPU checks and the batch-1 step A/B of session 22's opt-in switches.
# Region heads gated (KESTREL_JAX_REGION_GATE's kernel path; open must match XLA, closed must give
# the biases) for MD3 and MD2; the merged projection (KESTREL_JAX_MERGED_PROJ) against the default
# (final hidden states, bit-identical expected); then one probe process, batch-1 decode step (CUPTI
# + wall) for: default, each switch alone, all four.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/1_env.txt
for m in md3 md2; do
  timeout 100 python3 tools/check_region_heads.py --model $m --rows 1 8 --gate --out $OUT/x/1_gate_$m.json 2>&1 \
    | grep -v "$FILT" > $OUT/x/1_gate_$m.log
  echo "gate $m ($SECONDS s):"; tail -2 $OUT/x/1_gate_$m.log | cut -c1-900
done
timeout 100 python3 tools/check_decode_fusion.py --switch KESTREL_JAX_MERGED_PROJ --batches 1 3 \
  --out $OUT/x/1_fusion_mp.json 2>&1 | grep -v "$FILT" > $OUT/x/1_fusion_mp.log
echo "fusion ($SECONDS s):"; tail -6 $OUT/x/1_fusion_mp.log
ALL=KESTREL_JAX_MERGED_PROJ=1+KESTREL_JAX_L2_PREFETCH=30+KESTREL_JAX_REGION_GATE=1+KESTREL_JAX_HEADS_BARRIER=1
timeout $((590 - SECONDS)) python3 tools/probe_step_kernels.py --kernels 30 --model md3 --kinds decode --batch 1 \
  --sets default KESTREL_JAX_MERGED_PROJ=1 KESTREL_JAX_L2_PREFETCH=30 KESTREL_JAX_REGION_GATE=1 \
  KESTREL_JAX_HEADS_BARRIER=1 $ALL --json $OUT/x/1_probe1.json 2>&1 | grep -v "$FILT" > $OUT/x/1_probe1.log
echo "probe ($SECONDS s):"; grep "^\[" $OUT/x/1_probe1.log | tail -20
grep -A30 "^decode:" $OUT/x/1_probe1.log | head -80
cd $OUT && tar czf 1_all.tgz x && rm -rf x
