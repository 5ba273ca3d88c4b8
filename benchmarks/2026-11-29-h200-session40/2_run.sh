# Session 40, call 2 (H200): issue 3's prefill attention variants, kernel alone
# (`bench_attention.py --tune --tune-prefill-only`): the defaults against 64-row multi-consumer
# shapes, 128-key tiles (`block_k`) and FA3's intra-warpgroup overlap (`overlap`), at the image
# 740, image + prompt 1024 and 16 x 740 cases; every variant checked against the reference.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/2_env.txt
timeout 560 python3 tools/bench_attention.py --tune --tune-prefill-only --budget-s 470 \
  --out $OUT/x/2_prefill_tune.json > $OUT/x/2_prefill_tune.log 2>&1
echo "rc $? ($SECONDS s)"
grep -v "$FILT" $OUT/x/2_prefill_tune.log | grep -v "compiling\|ran once" | tail -60
cd $OUT && tar czf 2_all.tgz x && rm -rf x
