# Session 44, call 3 (H200): where MD3's (and MD2's) batch-1 decode step spends its time now (the last
# full listing: thirty-first session), every kernel with its HLO shape, and the steps' optimized HLO,
# to pick the next launches to remove for issue 6's W1 targets.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/3_env.txt
for m in md3 md2; do
  timeout 200 python3 tools/probe_step_kernels.py --kernels 120 --top 80 --model $m --kinds decode --batch 1 \
    --out-dir $OUT/x/3_probe_${m}_b1 --json $OUT/x/3_probe_${m}_b1.json 2>&1 | grep -v "$FILT" > $OUT/x/3_probe_${m}_b1.log
  echo "probe $m rc $? ($SECONDS s): $(grep '^decode: ' $OUT/x/3_probe_${m}_b1.log)"
done
cd $OUT && tar czf 3_all.tgz x && rm -rf x
