# Session 50, call 5 (the device time left, ~5 minutes): KESTREL_JAX_QKV_ATTENTION (new, opt-in): a
# decode step's QKV epilogue and split-KV attention as one Pallas Triton launch for layers without
# tau or routing (MD2). The full 24-layer MD2 forward at batch 1, switch on against off, then the
# batch-1 decode step's kernels (CUPTI) with and without it.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/5_env.txt
timeout 100 python3 tools/check_decode_fusion.py --model md2 --fused-dense-decode --switch KESTREL_JAX_QKV_ATTENTION \
  --batches 1 --out $OUT/x/5_check.json 2>&1 | grep -v "$FILT" > $OUT/x/5_check.log
echo "check ($SECONDS s):"; grep "max_rel\|rror" $OUT/x/5_check.log | cut -c1-260
timeout 115 python3 tools/probe_step_kernels.py --kernels 30 --top 25 --model md2 --kinds decode --batch 1 \
  --sets default KESTREL_JAX_QKV_ATTENTION=1 --json $OUT/x/5_probe_md2.json 2>&1 | grep -v "$FILT" > $OUT/x/5_probe_md2.log
echo "probe ($SECONDS s):"; grep "^\[.*\] decode:\|rror\|qkv\|attention" $OUT/x/5_probe_md2.log | cut -c1-150
cd $OUT && tar czf 5_all.tgz x && rm -rf x
