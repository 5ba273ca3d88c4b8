# Session 53 (2026-12-06), call 4 (any H100 / H200; the session's last ~5 device minutes): the decode
# GEMM kernel forming a dense layer's joined output + fc2 input row itself (KESTREL_JAX_DENSE_OUT_GELU_IN=1:
# attention's output and GELU_tanh of the fc1 columns read in place, instead of XLA's concat + GELU +
# pad fusion, 1.39 us x 24 in MD2's step). Kernel check, then MD2 and MD3 batch-1 probes.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
X=/tmp/x6; rm -rf $X; mkdir -p $X
save() { tar czf $OUT/6_all.tgz -C /tmp x6; }
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $X/6_env.txt
timeout 60 python3 tools/check_gelu_in.py --draws 4 --out $X/6_check.json 2>&1 | grep -v "$FILT" > $X/6_check.log
echo "check ($SECONDS s): rc ${PIPESTATUS[0]}"; cut -c1-250 $X/6_check.log | tail -6; save
for M in md2 md3; do
  timeout $((215 - SECONDS)) python3 tools/probe_step_kernels.py --kernels 45 --top 30 --model $M --kinds decode \
    --batch 1 --sets default KESTREL_JAX_DENSE_OUT_GELU_IN=1 --json $X/6_probe_$M.json 2>&1 \
    | grep -v "$FILT" > $X/6_probe_$M.log
  echo "probe $M ($SECONDS s):"; grep "^\[.*\] decode:\|rror\|gemv_mosaic\|loop_pad\|^decode:" $X/6_probe_$M.log | cut -c1-150; save
done
