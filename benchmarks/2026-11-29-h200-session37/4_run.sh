# Session 37, call 4 (H200): can XLA's Triton GEMMs take the GELU pass of MD2's prefill fc1 (25 us
# per layer in the mixed step; cuBLAS fuses no GELU, session 34)? MD2 mixed (1,536 prefill tokens +
# 64 decode rows) and decode steps, one probe process per XLA flag setting: the defaults,
# --xla_gpu_cublas_fallback=false (every GEMM a Triton GEMM, with its fusible producers and
# consumers) and --xla_gpu_triton_gemm_any=true.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/4_env.txt
i=0
for f in "" "--xla_gpu_cublas_fallback=false" "--xla_gpu_triton_gemm_any=true"; do
  i=$((i+1))
  [ $SECONDS -gt 250 ] && { echo "skip $i ($f): $SECONDS s"; continue; }
  XLA_FLAGS="$f" timeout $((400 - SECONDS < 150 ? 400 - SECONDS : 150)) python3 tools/probe_step_kernels.py \
    --kernels 30 --top 25 --model md2 --kinds mixed,decode --tokens 1536 --prompt 740 --batch 64 --context 800 \
    --wall-rounds 3 --json $OUT/x/4_${i}_probe.json 2>&1 | grep -v "$FILT" > $OUT/x/4_${i}_probe.log
  echo "probe $i '$f' ($SECONDS s):"; grep "launches (\|rror" $OUT/x/4_${i}_probe.log | cut -c1-160
  grep -i "multiply_fusion\|nvjet\|gemm_fusion\|triton" $OUT/x/4_${i}_probe.log | head -12 | cut -c1-150
done
cd $OUT && tar czf 4_all.tgz x && rm -rf x
