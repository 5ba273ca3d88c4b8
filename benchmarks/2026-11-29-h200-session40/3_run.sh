# Session 40, call 3 (H200): prefill attention with the new defaults (128-key tiles for three
# 64-row consumers; warpgroups skip key tiles past their own rows' limit), against `noskip`,
# 64-key tiles, four-consumer register splits and the overlap variants (`--tune-prefill-only`),
# then issue 3's target table (`--targets`).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/3_env.txt
timeout 330 python3 tools/bench_attention.py --tune --tune-prefill-only --budget-s 270 \
  --out $OUT/x/3_prefill_tune.json > $OUT/x/3_prefill_tune.log 2>&1
echo "tune rc $? ($SECONDS s)"
grep -v "$FILT" $OUT/x/3_prefill_tune.log | grep "^prefill\|summary\|SLOWER\|faster\|Error" | cut -c1-2000
timeout $((585 - SECONDS)) python3 tools/bench_attention.py --targets --budget-s 150 --out $OUT/x/3_attention.json 2>&1 \
  | grep -v "$FILT" > $OUT/x/3_attention.log
echo "targets ($SECONDS s):"; tail -24 $OUT/x/3_attention.log | cut -c1-200
cd $OUT && tar czf 3_all.tgz x && rm -rf x
