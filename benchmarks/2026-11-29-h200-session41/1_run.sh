# Session 41, call 1 (H200): decode attention, kernel alone (`bench_attention.py --tune`): the
# defaults against 32-row tiles (`t32`: one key row per thread, half the K/V/accumulator
# registers; `t32,d4`: with a four-deep load ring) at issue 3's decode cases, with ptxas's
# register/spill report; then issue 3's target table (`--targets`).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/1_env.txt
timeout 330 python3 tools/bench_attention.py --tune --ptxas-info --budget-s 260 --iters 40 \
  --out $OUT/x/1_decode_tune.json > $OUT/x/1_decode_tune.log 2>&1
echo "tune rc $? ($SECONDS s)"
grep -v "$FILT" $OUT/x/1_decode_tune.log | grep "^decode\|Error\|skipped" | cut -c1-1500
grep -i "registers\|spill" $OUT/x/1_decode_tune.log | sort | uniq -c | cut -c1-200 | head -20
timeout $((585 - SECONDS)) python3 tools/bench_attention.py --targets --budget-s 150 --out $OUT/x/1_attention.json 2>&1 \
  | grep -v "$FILT" > $OUT/x/1_attention.log
echo "targets ($SECONDS s):"; tail -24 $OUT/x/1_attention.log | cut -c1-200
cd $OUT && tar czf 1_all.tgz x && rm -rf x
