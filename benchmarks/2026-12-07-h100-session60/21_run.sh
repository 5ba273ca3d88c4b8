# Session 60, call 2 (any H100 / H200, a fresh machine; carry [".abtree"]: HEAD 7aae13d's kestrel_jax and
# tools, `git archive 7aae13d kestrel_jax tools | tar -x -C .abtree`; the tools put their own checkout first
# on sys.path). The decode launch's shared operands sliced once outside the multi-step loop
# (`runner._launch_rows`) against the tree before it (run as .abtree/tools/*.py): (1) the batch-1
# 8-iteration text-step launch's kernels (CUPTI), MD2 then MD3, new / old;
# (2) MD3 W1 new / old / new, each its own process, one compile cache per tree. Everything is tarred
# into $OUT/21_all.tgz (the device tool returns at most a few files) and the figures printed.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc\|^W1\|^I1'
X=/tmp/x21; mkdir -p $X
save() { tar czf $OUT/21_all.tgz -C /tmp x21; }
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $X/21_env.txt; cat $X/21_env.txt
declare -A TL=([new]=tools [old]=.abtree/tools)
for M in md2 md3; do
  for T in new old; do
    timeout 150 python3 ${TL[$T]}/probe_step_kernels.py --model $M --kinds decode --batch 1 \
      --steps 8 --text-step --iters 3 --wall-rounds 0 --top 25 --kernels 0 --json $X/21_probe_${M}_$T.json 2>&1 \
      | grep -v "$FILT" > $X/21_probe_${M}_$T.log
    echo "probe $M $T ($SECONDS s): $(grep 'decode:' $X/21_probe_${M}_$T.log | head -1 | cut -c1-100);" \
      "$(grep 'memcpy32_post' $X/21_probe_${M}_$T.log | head -1)"; save
  done
done
A="--random-weights --workloads w1 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
for T in new old new; do
  [ $SECONDS -gt 400 ] && [ ! -d /tmp/cc_$T ] && { echo "skip W1 $T (cold, $SECONDS s)"; continue; }
  timeout $((575 - SECONDS)) python3 ${TL[$T]}/benchmark.py --model md3 $A \
    --compile-cache /tmp/cc_$T --out $X/21_w1_md3_${T}_$SECONDS.json > $X/21_w1_md3_${T}_$SECONDS.log 2>&1
  echo "md3 W1 $T ($SECONDS s): $(grep -ho 'w1: .*of copy)' $X/21_w1_md3_${T}_*.log | tail -1)"; save
done
