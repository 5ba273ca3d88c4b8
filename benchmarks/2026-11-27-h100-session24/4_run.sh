# Session 24, call 4: where the W2 mixed step's device time goes now (two 740-token image prompts
# in the 1536 bucket, with and without 64 decode rows), kernel by kernel, with this session's
# defaults (region gate and heads barrier on).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
timeout 400 python3 tools/probe_step_kernels.py --kernels 60 --top 50 --model md3 --kinds prefill,mixed \
  --tokens 1536 --prompt 740 --batch 64 --json $OUT/x/4_probe_mixed.json 2>&1 | grep -v "$FILT" > $OUT/x/4_probe_mixed.log
echo "probe ($SECONDS s):"; grep "^\[\|: .* us in" $OUT/x/4_probe_mixed.log | head
cd $OUT && tar czf 4_all.tgz x && rm -rf x
