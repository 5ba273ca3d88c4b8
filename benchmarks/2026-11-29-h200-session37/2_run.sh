# Session 37, call 2 (H200): the sorted MoE regime's routing and grouping as two Pallas Triton
# launches (moe_sort_triton.sorted_route) against the jnp grouping (KESTREL_JAX_MOE_SORT_KERNEL=0:
# top-k sort, softmax, ~15 XLA fusions). (1) bench_moe, FP8 and bf16 layers at T 256 / 740 / 2048,
# each setting its own process, checked against the reference; (2) the MD3 W2 prefill step (two
# 740-token prompts) and mixed step, both settings in one probe process.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/2_env.txt
for s in on off on; do
  [ $s = off ] && E="env KESTREL_JAX_MOE_SORT_KERNEL=0" || E=env
  i=$((${i:-0}+1))
  timeout 150 $E python3 tools/bench_moe.py --tokens 256,740,2048 --precisions fp8,bf16 --no-routing-ab \
    --no-baselines --budget-s 110 --out $OUT/x/2_${i}_moe_$s.json 2>&1 | grep -v "$FILT" > $OUT/x/2_${i}_moe_$s.log
  echo "moe $i $s ($SECONDS s):"; grep -A8 "^    T mode" $OUT/x/2_${i}_moe_$s.log | head -9; grep -i "Traceback\|FAIL\|rror" $OUT/x/2_${i}_moe_$s.log | head -3
done
timeout $((585 - SECONDS)) python3 tools/probe_step_kernels.py --kernels 40 --top 30 --model md3 --kinds prefill,mixed \
  --tokens 1536 --prompt 740 --wall-rounds 3 --sets default KESTREL_JAX_MOE_SORT_KERNEL=0 \
  --json $OUT/x/2_probe.json 2>&1 | grep -v "$FILT" > $OUT/x/2_probe.log
echo "probe ($SECONDS s):"; grep "launches (\|rror" $OUT/x/2_probe.log | cut -c1-200
cd $OUT && tar czf 2_all.tgz x && rm -rf x
