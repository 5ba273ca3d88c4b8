# Prepared in session 61 (2026-12-07): the next session's first call (session 62 got no machine in ten
# tries; move it into the session's dated folder first, paths unchanged). An H200 runs session 60's
# 1a_run.sh (issue 6's MD3 / MD2 W1 on the card its targets name; then 1b_run.sh on the same machine,
# carrying [".peerx"]); an H100 runs the default-bucket
# W1 question of sessions 60-61 (MD3 W1 798-804 tok/s under the default decode buckets against 827-831 with
# 1,64 on the same machine): default buckets with decode_alone=True (decode steps autotuned alone) against
# plain defaults, each its own cold compile cache, then 1,64 as the control. Tarred into $OUT/31_all.tgz.
G=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "card: $G"
case "$G" in
  *H200*) bash benchmarks/2026-12-07-h100-session60/1a_run.sh; exit ;;
esac
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc\|^W1\|^I1'
export PYTHONPATH=$PWD
X=/tmp/x31; mkdir -p $X
save() { tar czf $OUT/31_all.tgz -C /tmp x31; }
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,driver_version --format=csv > $X/31_env.txt
W1() {  # $1 tag, rest: engine args
  local tag=$1; shift
  timeout $((590 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights --workloads w1 \
    --compile-cache /tmp/cc_$tag "$@" --out $X/31_w1_$tag.json 2>&1 | grep -v "$FILT" > $X/31_w1_$tag.log
  echo "md3 W1 $tag ($SECONDS s): $(grep -o 'w1: .*of copy)' $X/31_w1_$tag.log) $(grep -i 'rror' $X/31_w1_$tag.log | head -2)"; save
}
W1 alone --engine-args decode_alone=True
[ $SECONDS -lt 300 ] && W1 default
[ $SECONDS -lt 450 ] && W1 b1_64 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1
echo "done ($SECONDS s)"
