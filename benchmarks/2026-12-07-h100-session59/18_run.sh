# Session 59 call 5 (any H100 / H200): the text decode step (RunnerConfig.text_steps, new default: a
# multi-step launch of text rows runs a step without the region encoders, heads and argmaxes).
# (1) MD3 W1 on / off / on, each run its own process, one compile cache; (2) the MD3 batch-1
# 8-iteration decode launch's kernels, full step against text step; (3) MD2 W1 on / off if time is left.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc\|^W1\|^I1'
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/18_env.txt
A="--random-weights --workloads w1 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
w1() {  # model, text_steps
  timeout $((400 - SECONDS)) python3 tools/benchmark.py --model $1 $A runner.text_steps=$2 \
    --compile-cache /tmp/cc_$1 --out $OUT/18_w1_$1_$2_$SECONDS.json > /tmp/w1.log 2>&1
  echo "$1 text_steps=$2 ($SECONDS s): $(grep -o 'w1: .*of copy)' /tmp/w1.log)" | tee -a $OUT/18_w1.txt
  grep -i "error" /tmp/w1.log | head -3
}
w1 md3 True; w1 md3 False; w1 md3 True
for T in "" "--text-step"; do
  [ $SECONDS -gt 300 ] && break
  timeout $((390 - SECONDS)) python3 tools/probe_step_kernels.py --model md3 --kinds decode --batch 1 --steps 8 $T \
    --iters 3 --wall-rounds 0 --top 25 --kernels 0 --json $OUT/18_probe_md3${T:+_text}.json 2>&1 | grep -v "$FILT" > $OUT/18_probe_md3${T:+_text}.log
  echo "probe md3 ${T:-full} ($SECONDS s): $(grep '^decode:\|^\[.*decode:' $OUT/18_probe_md3${T:+_text}.log | cut -c1-100)"
done
[ $SECONDS -lt 250 ] && { w1 md2 True; w1 md2 False; }
