# Session 35, call 1 (H200): the residual + LayerNorm kernel over blocks of rows
# (layer_norm_blocks, new, on by default: the vision encoder's blocks and the text model's prefill and
# mixed steps). (1) the kernel vs XLA's launches at the vision and mixed-step shapes, rows/warps
# variants (tools/bench_layer_norm_blocks.py); (2) MD2's 4-image vision step and mixed step with it
# on / off and with the vision QKV product split in three (KESTREL_JAX_VISION_QKV_SPLIT=1), one
# process, the optimized HLO kept (probe --out-dir).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x/hlo
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/1_env.txt
timeout 150 python3 tools/bench_layer_norm_blocks.py --variants 1x4 2x4 4x4 4x8 8x8 1x2 --iters 10 \
  --out $OUT/x/1_bench.json 2>&1 | grep -v "$FILT" > $OUT/x/1_bench.log
echo "bench ($SECONDS s):"; grep "us/layer\|rror\|device" $OUT/x/1_bench.log | cut -c1-220 | head -30
timeout $((560 - SECONDS)) python3 tools/probe_step_kernels.py --kernels 40 --top 30 --model md2 --kinds images,mixed \
  --images 4 --batch 64 --context 800 --tokens 1536 --prompt 740 --wall-rounds 3 \
  --sets default KESTREL_JAX_BLOCK_LN=0 KESTREL_JAX_VISION_QKV_SPLIT=1 \
  --json $OUT/x/1_probe.json --out-dir $OUT/x/hlo 2>&1 | grep -v "$FILT" > $OUT/x/1_probe.log
echo "probe ($SECONDS s):"; grep "launches (\|rror" $OUT/x/1_probe.log | cut -c1-200
cd $OUT && tar czf 1_all.tgz x && rm -rf x
