# Session 58, the last call (~8 device minutes), two plans by the card that came. An H200 runs
# 1a_run.sh from pending (issue 6's batch-1 figures on the card its targets name). An H100 runs, at
# the session's final defaults (ROWS_STAGES_LN 5, no k_split): the batch-1 decode step's kernels for
# MD3 and MD2 (`probe_step_kernels.py`; the last MD3 probe was session 56's, before the MoE residual
# moved into the rows kernel), then MD3 W1 once.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
G=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "card: $G"
case "$G" in *H200*) bash benchmarks/pending/1a_run.sh; exit ;; esac
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/11_env.txt
for M in md3 md2; do
  timeout 150 python3 tools/probe_step_kernels.py --kernels 45 --top 30 --model $M --kinds decode --batch 1 \
    --json $OUT/11_probe_$M.json 2>&1 | grep -v "$FILT" > $OUT/11_probe_$M.log
  echo "probe $M ($SECONDS s):"; grep "decode:\|rror" $OUT/11_probe_$M.log | head -3 | cut -c1-200
done
A="--random-weights --workloads w1 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
[ $SECONDS -lt 300 ] && timeout $((450 - SECONDS)) python3 tools/benchmark.py --model md3 $A --compile-cache /tmp/cc_md3 \
  --out $OUT/11_w1_md3.json > /tmp/w1.log 2>&1
echo "md3 W1 ($SECONDS s): $(grep -o 'w1: .*of copy)' /tmp/w1.log)" | tee $OUT/11_w1.txt
