# Session 33, call 5 (H200): the MoE combine at small decode batches. Call 3's MD3 decode step at 8
# rows ran the combine + residual add (the default gather-reduce) as an `input_transpose_fusion` of
# 8.1 us per MoE layer (2.3 us at 1 row). KESTREL_JAX_COMBINE_UNROLLED_ROWS=64 adds the k gathered
# rows in order instead (no transpose, no reduction); A/B in one process per batch (probe --ab).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/5_env.txt
for B in 8 1 32; do
  [ $SECONDS -lt 270 ] && timeout $((340 - SECONDS)) python3 tools/probe_step_kernels.py --kernels 12 --top 14 --model md3 \
    --kinds decode --batch $B --steps 1 --wall-rounds 10 --ab KESTREL_JAX_COMBINE_UNROLLED_ROWS=0,64 \
    --json $OUT/x/5_probe_b$B.json 2>&1 | grep -v "$FILT" > $OUT/x/5_probe_b$B.log
  echo "b$B ($SECONDS s): $(grep "launches (" $OUT/x/5_probe_b$B.log | cut -c1-190)"
done
cd $OUT && tar czf 5_all.tgz x && rm -rf x
