# Session 63, same warm H100 as 31-33. 33_run.sh: the same cached bucket-1 executables run W1 at 841 with
# decode_buckets=1,64 loaded and at 809 with the default buckets: a runtime effect. Here both, served from
# the default run's cache (nothing compiles), each with a W1 trace window summarized (kernel time per step
# vs gaps), to see whether the GPU's kernels or the time between them grow.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc\|^W1\|^I1'
export PYTHONPATH=$PWD
X=/tmp/x34; mkdir -p $X
save() { tar czf $OUT/34_all.tgz -C /tmp x34 --exclude='*.pb' --exclude='*.trace.json.gz'; }
W1() {  # $1 tag, rest: engine args
  local tag=$1; shift
  timeout $((590 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights --workloads w1 \
    --compile-cache /tmp/cc_alone --trace-dir $X/tr_$tag "$@" --out $X/34_w1_$tag.json 2>&1 | grep -v "$FILT" > $X/34_w1_$tag.log
  echo "md3 W1 $tag ($SECONDS s): $(grep -o 'w1: .*of copy)' $X/34_w1_$tag.log) $(grep -o "'export_steps': {[^}]*}" $X/34_w1_$tag.log) $(grep -i 'rror' $X/34_w1_$tag.log | head -2)"; save
}
W1 default --engine-args decode_alone=True
W1 b1_64 --engine-args decode_buckets=1,64 decode_alone=True
echo "done ($SECONDS s)"
