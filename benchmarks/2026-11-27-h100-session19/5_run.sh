# Session 19, call 5: with programmatic dependent launch on (KESTREL_JAX_MOE_PDL=1, opt-in) the down
# GEMM now quantises its own rows and must load them only after griddepcontrol.wait: a full-size
# forward with PDL on vs off at 1 and 2 rows (W8A8 in the GEMMs); then the batch-1 decode step
# kernel by kernel with the new defaults (CUPTI).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
timeout 90 python3 tools/check_decode_fusion.py --switch KESTREL_JAX_MOE_PDL --batches 1 2 \
  --out $OUT/5_check.json 2>&1 | grep -v "$FILT" > $OUT/5_check.log
tail -2 $OUT/5_check.log
timeout 80 python3 tools/probe_step_kernels.py --kernels 20 --model md3 --kinds decode --batch 1 2>&1 \
  | grep -v "$FILT" > $OUT/5_probe.log
head -24 $OUT/5_probe.log
