# Session 12, call 2: the decode half of 7a (COMBINE_UNROLLED at 64 and 1 rows).
export PYTHONPATH=$PWD
mkdir -p /tmp/p
for b in 64 1; do
  timeout 100 python3 tools/probe_step_kernels.py --kernels 16 --model md3 --kinds decode --batch $b --json /tmp/p/dec${b}_base.json >> $OUT/2_probes.log 2>&1
  KESTREL_JAX_COMBINE_UNROLLED=1 timeout 100 python3 tools/probe_step_kernels.py --kernels 16 --model md3 --kinds decode --batch $b --json /tmp/p/dec${b}_unrolled.json >> $OUT/2_probes.log 2>&1
done
tar -czf $OUT/2_probes.tar.gz -C /tmp/p .
D="python3 tools/diff_step_kernels.py --top 8"
for pair in dec64_base:dec64_unrolled dec1_base:dec1_unrolled; do
  [ -f /tmp/p/${pair%%:*}.json ] && [ -f /tmp/p/${pair##*:}.json ] && $D /tmp/p/${pair%%:*}.json /tmp/p/${pair##*:}.json
done | tee $OUT/2_diffs.txt
