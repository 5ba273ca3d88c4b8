# Session 33, call 2 (H200): the three kernel benchmarks of issues 3-5 at their target cases, on
# the H200 (every earlier run of them was on an H100): MoE layer FP8 and bf16 at T 1/4/16/740,
# paged attention --targets, sampling. Kestrel's kernels on the same GPU follow in call 3.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/2_env.txt
timeout 170 python3 tools/bench_moe.py --tokens 1,4,16,740 --precisions fp8,bf16 --no-routing-ab --no-baselines \
  --budget-s 125 --out $OUT/x/2_moe.json 2>&1 | grep -v "$FILT" > $OUT/x/2_moe.log
echo "moe ($SECONDS s):"; grep -A14 "^    T mode" $OUT/x/2_moe.log | head -16; grep -i "Traceback\|FAILED" $OUT/x/2_moe.log | head -3
timeout 200 python3 tools/bench_attention.py --targets --budget-s 140 --out $OUT/x/2_attention.json 2>&1 \
  | grep -v "$FILT" > $OUT/x/2_attention.log
echo "attention ($SECONDS s):"; tail -40 $OUT/x/2_attention.log | cut -c1-180
timeout $((585 - SECONDS)) python3 tools/bench_sampling.py --budget-s 110 --out $OUT/x/2_sampling.json 2>&1 \
  | grep -v "$FILT" > $OUT/x/2_sampling.log
echo "sampling ($SECONDS s):"; tail -30 $OUT/x/2_sampling.log | cut -c1-180
cd $OUT && tar czf 2_all.tgz x && rm -rf x
