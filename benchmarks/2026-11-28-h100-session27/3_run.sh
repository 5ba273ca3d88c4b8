# Session 27, call 3: what the host does while a step call launches. Call 2's probe: the mixed step's
# call took 10.75 ms to return (kernels 19.3 ms incl. the probe's 3.6 ms pool copy, wall 27.9 ms) and
# decode K=1 at B=64 4.57 ms (kernels 10.2, wall 14.5): the wall exceeds the kernel sum by about the
# launch time, so the device waits on the launch. Host trace of 3 calls (XLA's host events per call),
# with host numpy inputs (as the engine) and with the same device inputs each call, and decode K=1
# under XLA's command buffers off / with custom calls and graphs of any size.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/3_env.txt
run() {  # name, XLA_FLAGS, probe args
  [ $SECONDS -gt 500 ] && { echo "skip $1: $SECONDS s"; return; }
  XLA_FLAGS="$2" timeout $((590 - SECONDS)) python3 tools/probe_step_kernels.py --kernels 8 --top 25 --model md3 \
    --wall-rounds 10 --iters 3 --host-trace /tmp/ht_$1 --json $OUT/x/3_$1.json $3 2>&1 | grep -v "$FILT" > $OUT/x/3_$1.log
  echo "$1 ($SECONDS s): $(grep "launches (" $OUT/x/3_$1.log | head -1)"; grep -i "Traceback\|Error" $OUT/x/3_$1.log | head -3
  f=$(find /tmp/ht_$1 -name "*.xplane.pb" | head -1); [ -n "$f" ] && gzip -c $f > $OUT/x/3_$1.xplane.pb.gz
}
run dec1 "" "--kinds decode --steps 1"
run dec1_devin "" "--kinds decode --steps 1 --device-inputs"
run dec1_cboff "--xla_gpu_enable_command_buffer=" "--kinds decode --steps 1"
run dec1_cball "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN --xla_gpu_graph_min_graph_size=1" "--kinds decode --steps 1"
run mixed "" "--kinds mixed"
for f in $OUT/x/3_dec1.log $OUT/x/3_mixed.log; do echo "== $f"; sed -n '/host events per call/,/launches (/p' $f | head -45; done
ls -la $OUT/x
cd $OUT && tar czf 3_all.tgz x && rm -rf x
