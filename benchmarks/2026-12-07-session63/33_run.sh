# Session 63, same warm H100 as 31/32: 32_run.sh showed the W1 gap follows the decode buckets alone
# (default prefill/vision buckets with decode_buckets=1,64: 839.2; default decode buckets: 809-812).
# Is it the bucket-1 executable (compiled differently) or a runtime effect of more executables loaded?
# (a) decode_buckets=1,64 served from the default-bucket run's cache (its b1 programs, fewer loaded);
# (b) the default decode buckets served from the 1,64 run's cache (its b1 programs; the others compile).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc\|^W1\|^I1'
export PYTHONPATH=$PWD
X=/tmp/x33; mkdir -p $X
save() { tar czf $OUT/33_all.tgz -C /tmp x33; }
W1() {  # $1 tag, $2 cache, rest: engine args
  local tag=$1 cc=$2; shift 2
  timeout $((590 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights --workloads w1 \
    --compile-cache /tmp/cc_$cc "$@" --out $X/33_w1_$tag.json 2>&1 | grep -v "$FILT" > $X/33_w1_$tag.log
  echo "md3 W1 $tag ($SECONDS s): $(grep -o 'w1: .*of copy)' $X/33_w1_$tag.log) $(grep -o "'create_s': [0-9.]*" $X/33_w1_$tag.log) $(grep -o "'export_steps': {[^}]*}" $X/33_w1_$tag.log) $(grep -i 'rror' $X/33_w1_$tag.log | head -2)"; save
}
ls /tmp/cc_alone | wc -l
W1 a_1_64_from_alone alone --engine-args decode_buckets=1,64 decode_alone=True
W1 b_default_from_dec1_64 dec1_64
echo "done ($SECONDS s)"
