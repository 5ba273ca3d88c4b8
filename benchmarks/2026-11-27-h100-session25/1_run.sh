# Session 25, call 1: the sorted (prefill) MoE regime's block size. Nt = 128 pads each expert's
# rows up to a multiple of 128: at T=1480-1536 (W2's two 740-token prompts) ~185-192 rows per expert
# become 256 (~30% padded FLOPs), where Nt = 64 gives 192. (1) the MoE layer alone, FP8, Nt 128 vs
# 64 at T = 740 .. 2048; (2) the W2 prefill step (two 740-token prompts, 1536 bucket) with
# KESTREL_JAX_MOE_SORTED_NT=128,64; (3) the vision step of 4 one-crop images, kernel by kernel.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/1_env.txt
timeout 200 python3 tools/bench_moe.py --precisions fp8 --no-baselines --tokens 740,1024,1480,1536,2048 \
  --budget-s 150 --out $OUT/x/1_moe.json 2>&1 | grep -v "$FILT" > $OUT/x/1_moe.log
echo "moe ($SECONDS s):"; grep -A14 "^    T mode" $OUT/x/1_moe.log
timeout 220 python3 tools/probe_step_kernels.py --kernels 40 --top 30 --model md3 --kinds prefill \
  --tokens 1536 --prompt 740 --ab KESTREL_JAX_MOE_SORTED_NT=128,64 --json $OUT/x/1_probe_nt.json 2>&1 \
  | grep -v "$FILT" > $OUT/x/1_probe_nt.log
echo "probe nt ($SECONDS s):"; grep "^\[\|: .* us in\|diff\|moe\|grouped" $OUT/x/1_probe_nt.log | head -30
timeout $((580 - SECONDS)) python3 tools/probe_step_kernels.py --kernels 40 --top 30 --model md3 --kinds images \
  --images 4 --json $OUT/x/1_probe_images.json 2>&1 | grep -v "$FILT" > $OUT/x/1_probe_images.log
echo "probe images ($SECONDS s):"; grep -A32 "^images" $OUT/x/1_probe_images.log | head -70
cd $OUT && tar czf 1_all.tgz x && rm -rf x
