# Prepared in session 63 (2026-12-07): the next session's first call (move it into the session's dated
# folder first, paths unchanged; carry [".peerx"]). An H200 runs session 60's 1a_run.sh (issue 6's W1 on
# the card its targets name; then 1b_run.sh on the same machine). An H100 bisects session 63's finding
# (benchmarks/2026-12-07-session63/31-34): the same cached bucket-1 decode executable runs MD3 W1 at 809-812
# tok/s with the default decode buckets loaded and 839-841 with 1,64; a trace shows the same CUDA graph with
# ~0.45 us between its kernels in the first case and ~0.03 us (kernels overlapping) in the second.
# One cold compile of the default buckets, then warm runs served from that cache (nothing compiles):
# default (baseline); default with the engine's warm-up off (warmup=False: the other buckets' executables
# loaded but never run, so their CUDA graphs are never instantiated: is it the graphs instantiated or the
# executables loaded?); subsets of the decode buckets (1,2,4,8 and 1,16,32,48,64: their count or some
# bucket?); 1,64 (control). num_pages is pinned at the default's 4992 in all, so every run after the first
# is a cache hit. The default and 1,64 runs trace a W1 window: the JSON's w1.trace.graph_launch_gaps gives
# the kernel-to-kernel gaps inside the decode graph at each level.
G=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "card: $G"
case "$G" in
  *H200*) bash benchmarks/2026-12-07-h100-session60/1a_run.sh; exit ;;
esac
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc\|^W1\|^I1'
export PYTHONPATH=$PWD
X=/tmp/x35; mkdir -p $X
save() { tar czf $OUT/35_all.tgz --exclude='*.pb' --exclude='*.json.gz' -C /tmp x35; }
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,driver_version --format=csv > $X/35_env.txt
W1() {  # $1 tag, rest: engine args
  local tag=$1; shift
  timeout $((590 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights --workloads w1 \
    --compile-cache /tmp/cc35 "$@" --out $X/35_w1_$tag.json 2>&1 | grep -v "$FILT" > $X/35_w1_$tag.log
  echo "md3 W1 $tag ($SECONDS s): $(grep -o 'w1: .*of copy)' $X/35_w1_$tag.log) $(grep -o "'create_s': [0-9.]*" $X/35_w1_$tag.log) $(grep -o "'export_steps': {[^}]*}" $X/35_w1_$tag.log) $(grep -i 'rror' $X/35_w1_$tag.log | head -2)"; save
}
W1 cold --engine-args runner.num_pages=4992
W1 default --trace-dir $X/tr_default --engine-args runner.num_pages=4992
W1 default_nowarm --engine-args runner.num_pages=4992 warmup=False
W1 d1_2_4_8 --engine-args runner.num_pages=4992 decode_buckets=1,2,4,8
W1 d1_16_32_48_64 --engine-args runner.num_pages=4992 decode_buckets=1,16,32,48,64
W1 d1_64 --trace-dir $X/tr_d1_64 --engine-args runner.num_pages=4992 decode_buckets=1,64
echo "done ($SECONDS s)"
