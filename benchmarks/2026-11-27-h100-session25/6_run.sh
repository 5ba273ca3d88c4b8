# Session 25, call 6: the QKV epilogue kernel (rotary, tau scaling, FP8 KV write in one launch, tau
# factors from XLA) at prefill size against the prefill step's XLA path (tau factors, rotary of q
# and k as concat fusions, v * tau, the KV write kernel: ~28 us per layer of glue in call 1's
# prefill step). MD3 shapes, 1536 and 64 rows, 8 cold layers.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
timeout 240 python3 tools/bench_qkv_epilogue.py --models md3 --rows 1536 64 --layers 8 --iters 10 \
  --out $OUT/x/6_qkv_epilogue.json 2>&1 | grep -v "$FILT" > $OUT/x/6_qkv_epilogue.log
echo "($SECONDS s)"; tail -20 $OUT/x/6_qkv_epilogue.log | cut -c1-300
cd $OUT && tar czf 6_all.tgz x && rm -rf x
