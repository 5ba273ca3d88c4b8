# Session 34, call 3 (H200): the prefill QKV epilogue kernel (qkv_epilogue.prefill_qkv_kernel, new:
# rotary, tau scaling from XLA's factors and the KV write of a prefill / mixed step's rows in one
# launch, q split into the mixed step's decode and prefill rows). (1) kernel vs the model's XLA
# path at MD2/MD3 prefill sizes, compiled on the GPU (correctness and us per layer, warps 4/2/8);
# (2) MD2 mixed + prefill steps and MD3 prefill step A/B in one process (probe --ab); (3) the mixed
# step against a decode step + a prefill step, MD3 (tools/check_mixed_step.py).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/3_env.txt
timeout 150 python3 tools/bench_qkv_epilogue.py --prefill 1600:64 1536:0 --warps 0 2 8 --iters 10 \
  --out $OUT/x/3_bench.json 2>&1 | grep -v "$FILT" > $OUT/x/3_bench.log
echo "bench ($SECONDS s):"; grep "us/layer\|rror" $OUT/x/3_bench.log | cut -c1-200 | head -12
timeout 200 python3 tools/probe_step_kernels.py --kernels 30 --top 30 --model md2 --kinds mixed,prefill \
  --batch 64 --context 800 --tokens 1536 --prompt 740 --wall-rounds 5 --ab KESTREL_JAX_PREFILL_QKV_KERNEL=0,1 \
  --json $OUT/x/3_probe_md2.json 2>&1 | grep -v "$FILT" > $OUT/x/3_probe_md2.log
echo "probe md2 ($SECONDS s):"; grep "launches (\|rror" $OUT/x/3_probe_md2.log | cut -c1-200
timeout $((470 - SECONDS)) python3 tools/probe_step_kernels.py --kernels 30 --top 30 --model md3 --kinds prefill \
  --tokens 2048 --prompt 740 --wall-rounds 5 --ab KESTREL_JAX_PREFILL_QKV_KERNEL=0,1 \
  --json $OUT/x/3_probe_md3.json 2>&1 | grep -v "$FILT" > $OUT/x/3_probe_md3.log
echo "probe md3 ($SECONDS s):"; grep "launches (\|rror" $OUT/x/3_probe_md3.log | cut -c1-200
timeout $((585 - SECONDS)) python3 tools/check_mixed_step.py --model md3 --out $OUT/x/3_mixed_md3.json 2>&1 \
  | grep -v "$FILT" > $OUT/x/3_mixed_md3.log
echo "mixed ($SECONDS s):"; tail -8 $OUT/x/3_mixed_md3.log | cut -c1-200
cd $OUT && tar czf 3_all.tgz x && rm -rf x
