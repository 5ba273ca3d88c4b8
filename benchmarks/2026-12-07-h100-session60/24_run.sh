# Session 60, call 2 as retried after two refusals (~600 s of device time lost to them; what is left does
# not hold calls 21 and 22 whole). Carry [".abtree"] (see 21_run.sh). An H200 runs 1a_run.sh (issue 6's
# MD3 / MD2 W1 on the card its targets name; 1b_run.sh next if time is left). An H100 runs the kernel probes
# of 21_run.sh (new / old tree, MD2 and MD3), then MD3's cold start with the default buckets (22_run.sh).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc\|^W1\|^I1'
G=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "card: $G"
case "$G" in
  *H200*) bash benchmarks/2026-12-07-h100-session60/1a_run.sh; exit ;;
esac
export PYTHONPATH=$PWD
X=/tmp/x24; mkdir -p $X
save() { tar czf $OUT/24_all.tgz -C /tmp x24; }
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $X/24_env.txt
declare -A TL=([new]=tools [old]=.abtree/tools)
for M in md2 md3; do
  for T in new old; do
    timeout 150 python3 ${TL[$T]}/probe_step_kernels.py --model $M --kinds decode --batch 1 \
      --steps 8 --text-step --iters 3 --wall-rounds 0 --top 25 --kernels 0 --json $X/24_probe_${M}_$T.json 2>&1 \
      | grep -v "$FILT" > $X/24_probe_${M}_$T.log
    echo "probe $M $T ($SECONDS s): $(grep 'decode:' $X/24_probe_${M}_$T.log | head -1 | cut -c1-100);" \
      "$(grep 'memcpy32_post' $X/24_probe_${M}_$T.log | head -1)"; save
  done
done
for T in True False; do
  [ $SECONDS -gt 300 ] && { echo "skip startup text_steps=$T ($SECONDS s)"; continue; }
  timeout $((585 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights --workloads startup \
    --engine-args runner.text_steps=$T --compile-cache /tmp/cs_$T --out $X/24_startup_md3_$T.json \
    2>&1 | grep -v "$FILT" > $X/24_startup_md3_$T.log
  echo "md3 startup text_steps=$T ($SECONDS s): $(grep -o "engine ready: .\{0,160\}" $X/24_startup_md3_$T.log)"
  grep -i "error\|start failed" $X/24_startup_md3_$T.log | head -3; save
done
