# Prepared in session 56 (2026-12-07) for any H100 / H200 (~9 device minutes; move it into the session's
# dated folder first). Session 56 found the one-row rows kernel faster with a 6-slot TMA ring than 8
# (224 CTAs streaming at once: the first tiles queue behind fewer loads). The MoE dense regime (T <= 64)
# runs 132 persistent CTAs x 8 slots. (1) bench_moe's FP8 layer at T = 1, 4, 8 with rings of 4 and 6
# slots beside the default 8 (--stages-ab); (2) MD3 W1 with KESTREL_JAX_MOE_DENSE_STAGES=6 (and 4 if
# time is left) against the default, alternating, each run its own process and compile cache. Change the
# dense regime's default only if (2) says so.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/5_env.txt
timeout 200 python3 tools/bench_moe.py --tokens 1,4,8 --precisions fp8 --stages-ab --no-baselines --budget-s 150 \
  --out $OUT/5_moe.json 2>&1 | grep -v "$FILT" > $OUT/5_moe.log
grep "T=" $OUT/5_moe.log | cut -c1-160
A="--random-weights --workloads w1 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
for s in 8 6 6 8 4; do
  [ $SECONDS -gt 430 ] && break
  KESTREL_JAX_MOE_DENSE_STAGES=$s timeout $((580 - SECONDS)) python3 tools/benchmark.py --model md3 $A \
    --compile-cache /tmp/cc_md3_$s --out $OUT/5_w1_md3_st${s}_$SECONDS.json > /tmp/w1.log 2>&1
  echo "md3 MoE dense ring $s ($SECONDS s): $(grep -o 'w1: .*of copy)' /tmp/w1.log)" | tee -a $OUT/5_w1.txt
done
