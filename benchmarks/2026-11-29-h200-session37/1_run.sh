# Session 37, call 1 (H200): issue 5's greedy rows against XLA's argmax. The sampler's new
# single-launch mode (each program forms its row's chunk statistics in a pass of its own, then
# finishes the row: one launch instead of two) at several tile widths / warp counts, beside the
# two-launch default, argmax and the baselines; every single-launch config checked against the
# reference. Batches 1-256, bf16 and f32.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/1_env.txt
timeout 560 python3 tools/bench_sampling.py --budget-s 480 --settings greedy,top_p,md3_query,mixed \
  --configs 512:8:s,512:16:s,1024:16:s,1024:32:s,2048:32:s --out $OUT/x/1_sampling.json 2>&1 \
  | grep -v "$FILT" > $OUT/x/1_sampling.log
echo "sampling ($SECONDS s):"; grep "greedy\|MISMATCH\|rror" $OUT/x/1_sampling.log | cut -c1-150 | head -80
cd $OUT && tar czf 1_all.tgz x && rm -rf x
