# Session 26, call 1: the sorted (prefill) MoE GEMMs. Session 25's Nsight Compute run at T=1480
# showed DRAM at ~70% of peak for ~1.6x the layer's ideal bytes and the tensor pipe 42% busy with one
# warpgroup per SM issuing every 3.3 cycles. Two cheap levers, both switches now: (a) units in
# (block, slice) order, slice fastest, so each block's token rows stay in L2 while its 16 slices run
# (block fastest re-reads every block's rows once per slice pass); (b) two CTAs per SM, each with a
# ring cut to half the SMEM, so one CTA's epilogue overlaps the other's MMAs.
# (1) MoE layer alone, FP8, T 740 and 1480: Nt 128 / 64 x order x grid (checked vs the reference);
# (2) the W2 prefill step (two 740-token prompts, 1536 bucket) with the switches; (3) ncu occupancy
# and speed-of-light of the up / down GEMMs at T=1480 for the variants.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/1_env.txt
timeout 230 python3 tools/bench_moe.py --precisions fp8 --no-baselines --tokens 740,1480 --sorted-ab --rotate 2 \
  --budget-s 200 --out $OUT/x/1_moe.json 2>&1 | grep -v "$FILT" > $OUT/x/1_moe.log
echo "moe ($SECONDS s):"; grep -A18 "^    T mode" $OUT/x/1_moe.log; grep -i "error\|FAILED\|Traceback" $OUT/x/1_moe.log | head -5
timeout 230 python3 tools/probe_step_kernels.py --kernels 20 --top 12 --model md3 --kinds prefill \
  --tokens 1536 --prompt 740 --sets default KESTREL_JAX_MOE_SORTED_ORDER=slices KESTREL_JAX_MOE_SORTED_CTAS_PER_SM=2 \
  KESTREL_JAX_MOE_SORTED_ORDER=slices+KESTREL_JAX_MOE_SORTED_CTAS_PER_SM=2 \
  --wall-rounds 10 --json $OUT/x/1_probe.json 2>&1 | grep -v "$FILT" > $OUT/x/1_probe.log
echo "probe ($SECONDS s):"; grep -A3 "^\[" $OUT/x/1_probe.log | head -24; grep -i "error\|Traceback" $OUT/x/1_probe.log | head -5
timeout $((575 - SECONDS)) /usr/local/cuda/bin/ncu -k regex:mosaic_gpu_kernel --section SpeedOfLight --section Occupancy \
  python3 tools/profile_moe.py 1480 1480:slices_fastest=1 1480:num_ctas=264:smem_limit=115712 \
  1480:num_ctas=264:smem_limit=115712:slices_fastest=1 > $OUT/x/1_ncu.txt 2>&1
echo "ncu ($SECONDS s): $(grep -c 'Section: GPU Speed' $OUT/x/1_ncu.txt) kernels"
grep "mosaic_gpu_kernel (\|Duration\|Compute (SM) Throughput\|DRAM Throughput\|L2 Cache Throughput\|Block Limit Shared\|Block Limit Reg\|Achieved Occupancy" $OUT/x/1_ncu.txt | grep -v "^==" | cut -c1-100 | head -60
cd $OUT && tar czf 1_all.tgz x && rm -rf x
