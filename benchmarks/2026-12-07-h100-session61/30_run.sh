# Session 61 (2026-12-07), for an H100 (or any card): (1) MD3's cold start with the engine's default buckets
# and the lowering cache on (the default; session 60: 277.7 s before the cache, 182.5 s without the text
# step, another H100); (2) MD3 W1 under the default buckets on that warm cache, (3) MD3 W1 with decode
# buckets 1,64 on a cache of its own (session 60: 798.3 default vs 827.3 with 1,64 on one machine, one run
# each), (4) the default-bucket W1 again if time is left. Everything tarred into $OUT/30_all.tgz.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc\|^W1\|^I1'
export PYTHONPATH=$PWD
X=/tmp/x30; mkdir -p $X
save() { tar czf $OUT/30_all.tgz -C /tmp x30; }
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,driver_version --format=csv > $X/30_env.txt; cat $X/30_env.txt
timeout 330 python3 tools/benchmark.py --model md3 --random-weights --workloads startup --compile-cache /tmp/cs_1 \
  --out $X/30_startup_md3.json 2>&1 | grep -v "$FILT" > $X/30_startup_md3.log
echo "md3 cold startup, default buckets, lowering cache on ($SECONDS s): $(grep -o "engine ready: .\{0,300\}" $X/30_startup_md3.log)"
grep -i "error\|start failed" $X/30_startup_md3.log | head -3; save
W1() {  # $1 tag, $2 cache, rest: engine args
  local tag=$1 cc=$2; shift 2
  timeout $((590 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights --workloads w1 --compile-cache $cc \
    "$@" --out $X/30_w1_$tag.json 2>&1 | grep -v "$FILT" > $X/30_w1_$tag.log
  echo "md3 W1 $tag ($SECONDS s): $(grep -o 'w1: .*of copy)' $X/30_w1_$tag.log) $(grep -i 'rror' $X/30_w1_$tag.log | head -2)"; save
}
[ $SECONDS -lt 470 ] && W1 default /tmp/cs_1
[ $SECONDS -lt 400 ] && W1 b1_64 /tmp/cc_b --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1
[ $SECONDS -lt 520 ] && W1 default2 /tmp/cs_1
echo "done ($SECONDS s)"
