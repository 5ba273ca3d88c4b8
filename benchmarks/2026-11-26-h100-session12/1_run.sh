# Session 12, call 1: the prefill half of session 11's planned probes (7a_planned_probes.sh).
export PYTHONPATH=$PWD
mkdir -p /tmp/p
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/1_probes.log
P="timeout 115 python3 tools/probe_step_kernels.py --kernels 16"
$P --model md3 --kinds prefill --json /tmp/p/md3_pre_base.json >> $OUT/1_probes.log 2>&1
KESTREL_JAX_TAU_GELU=poly $P --model md3 --kinds prefill --json /tmp/p/md3_pre_gelu.json >> $OUT/1_probes.log 2>&1
KESTREL_JAX_SPLIT_DENSE_GEMMS=1 $P --model md3 --kinds prefill --json /tmp/p/md3_pre_split.json >> $OUT/1_probes.log 2>&1
$P --model md2 --kinds prefill --json /tmp/p/md2_pre_base.json >> $OUT/1_probes.log 2>&1
KESTREL_JAX_SPLIT_DENSE_GEMMS=1 $P --model md2 --kinds prefill --json /tmp/p/md2_pre_split.json >> $OUT/1_probes.log 2>&1
tar -czf $OUT/1_probes.tar.gz -C /tmp/p .
D="python3 tools/diff_step_kernels.py --top 8"
for pair in md3_pre_base:md3_pre_gelu md3_pre_base:md3_pre_split md2_pre_base:md2_pre_split; do
  [ -f /tmp/p/${pair%%:*}.json ] && [ -f /tmp/p/${pair##*:}.json ] && $D /tmp/p/${pair%%:*}.json /tmp/p/${pair##*:}.json
done | tee $OUT/1_diffs.txt
