# Session 63, same warm H100 as 31_run.sh: the W1 gap between default buckets (decode_alone=True: 812.5)
# and 1,64 (838.5). Repeat both on their warm compile caches (is the gap stable?), then default prefill and
# vision buckets with decode_buckets=1,64 alone (cold), to see which bucket set carries it.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc\|^W1\|^I1'
export PYTHONPATH=$PWD
X=/tmp/x32; mkdir -p $X
save() { tar czf $OUT/32_all.tgz -C /tmp x32; }
W1() {  # $1 tag, $2 cache, rest: engine args
  local tag=$1 cc=$2; shift 2
  timeout $((590 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights --workloads w1 \
    --compile-cache /tmp/cc_$cc "$@" --out $X/32_w1_$tag.json 2>&1 | grep -v "$FILT" > $X/32_w1_$tag.log
  echo "md3 W1 $tag ($SECONDS s): $(grep -o 'w1: .*of copy)' $X/32_w1_$tag.log) $(grep -o "'create_s': [0-9.]*" $X/32_w1_$tag.log) $(grep -i 'rror' $X/32_w1_$tag.log | head -2)"; save
}
W1 b1_64 b1_64 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1
W1 alone alone --engine-args decode_alone=True
W1 b1_64_again b1_64 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1
[ $SECONDS -lt 250 ] && W1 dec1_64 dec1_64 --engine-args decode_buckets=1,64
echo "done ($SECONDS s)"
