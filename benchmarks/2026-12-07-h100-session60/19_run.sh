# Prepared in session 59 (2026-12-07) for any H100 / H200 (~7 device minutes; move it into the session's
# dated folder first). The text decode step (RunnerConfig.text_steps, default since session 59: MD3 W1
# +2.0% on an H100) on MD2, which session 59's call did not reach: (1) MD2 W1 on / off / on, each run its
# own process, one compile cache per setting; (2) the batch-1 8-iteration decode launch's kernels, full
# step against text step, MD2 then MD3 (CUPTI), to say which launches went.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc\|^W1\|^I1'
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/19_env.txt
A="--random-weights --workloads w1 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
w1() {  # model, text_steps
  timeout $((560 - SECONDS)) python3 tools/benchmark.py --model $1 $A runner.text_steps=$2 \
    --compile-cache /tmp/cc_$1_$2 --out $OUT/19_w1_$1_$2_$SECONDS.json > /tmp/w1.log 2>&1
  echo "$1 text_steps=$2 ($SECONDS s): $(grep -o 'w1: .*of copy)' /tmp/w1.log)" | tee -a $OUT/19_w1.txt
  grep -i "error" /tmp/w1.log | head -3
}
w1 md2 True; w1 md2 False; w1 md2 True
for M in md2 md3; do
  for T in "" "--text-step"; do
    [ $SECONDS -gt 480 ] && break
    timeout $((570 - SECONDS)) python3 tools/probe_step_kernels.py --model $M --kinds decode --batch 1 --steps 8 $T \
      --iters 3 --wall-rounds 0 --top 25 --kernels 0 --json $OUT/19_probe_$M${T:+_text}.json 2>&1 \
      | grep -v "$FILT" > $OUT/19_probe_$M${T:+_text}.log
    echo "probe $M ${T:-full} ($SECONDS s): $(grep 'decode:' $OUT/19_probe_$M${T:+_text}.log | head -1 | cut -c1-100)"
  done
done
