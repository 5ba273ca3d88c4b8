# Session 40, call 5 (H200, the session's last device minutes): decode attention, kernel alone
# (`bench_attention.py --tune`): the defaults against KV heads sharing a CTA (`heads_per_cta` 2
# and 4: one load ring over the heads' tiles; B=32 at 128 tokens becomes 512 CTAs, one wave at
# four CTAs per SM) at issue 3's decode cases; every variant checked against the reference.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/5_env.txt
timeout 330 python3 tools/bench_attention.py --tune --budget-s 250 --iters 40 \
  --out $OUT/x/5_decode_tune.json > $OUT/x/5_decode_tune.log 2>&1
echo "tune rc $? ($SECONDS s)"
grep -v "$FILT" $OUT/x/5_decode_tune.log | grep "^decode\|Error\|skipped" | cut -c1-1500
cd $OUT && tar czf 5_all.tgz x && rm -rf x
