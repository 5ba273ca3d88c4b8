# Session 35, call 2 (H200): call 1 measured the residual + LayerNorm kernel on (default) against off:
# MD2 4-image vision step -2.0%, mixed step -0.8%; the vision QKV split (no barrier) -0.7% more,
# XLA having merged the three products back. (1) the kernel's rows/warps variants alone
# (tools/bench_layer_norm_blocks.py, copy bandwidth fixed); (2) MD2 vision step: the split behind a
# barrier (three GEMMs with their biases), and the best variant of (1); (3) MD3 prefill step with
# the kernel on / off.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/2_env.txt
timeout 150 python3 tools/bench_layer_norm_blocks.py --variants 1x4 2x4 4x4 8x4 1x2 2x2 2x8 4x8 8x8 16x8 --iters 10 \
  --out $OUT/x/2_bench.json 2>&1 | grep -v "$FILT" > $OUT/x/2_bench.log
echo "bench ($SECONDS s):"; grep "us/layer\|rror\|device" $OUT/x/2_bench.log | cut -c1-200 | head -40
BEST=$(python3 -c "
import json; r=[x for x in json.load(open('$OUT/x/2_bench.json'))['results'] if x['case']=='vision4' and x['variant']!='xla']
b=min(r, key=lambda x: x['us_per_layer'])['variant'].split('/')[1].split('x'); print(f'KESTREL_JAX_BLOCK_LN_ROWS={b[0]}+KESTREL_JAX_BLOCK_LN_WARPS={b[1]}')" || echo default)
echo "best vision variant: $BEST"
timeout $((400 - SECONDS)) python3 tools/probe_step_kernels.py --kernels 40 --top 30 --model md2 --kinds images \
  --images 4 --wall-rounds 3 --sets default KESTREL_JAX_VISION_QKV_SPLIT=1 $BEST \
  --json $OUT/x/2_probe_md2.json 2>&1 | grep -v "$FILT" > $OUT/x/2_probe_md2.log
echo "probe md2 ($SECONDS s):"; grep "launches (\|rror" $OUT/x/2_probe_md2.log | cut -c1-200
timeout $((570 - SECONDS)) python3 tools/probe_step_kernels.py --kernels 30 --top 30 --model md3 --kinds prefill \
  --tokens 2048 --prompt 740 --wall-rounds 3 --ab KESTREL_JAX_BLOCK_LN=0,1 \
  --json $OUT/x/2_probe_md3.json 2>&1 | grep -v "$FILT" > $OUT/x/2_probe_md3.log
echo "probe md3 ($SECONDS s):"; grep "launches (\|rror" $OUT/x/2_probe_md3.log | cut -c1-200
cd $OUT && tar czf 2_all.tgz x && rm -rf x
