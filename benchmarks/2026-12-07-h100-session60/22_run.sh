# Session 60, call 3 (chained on call 2's machine): MD3's start-up with the engine's default buckets (eight
# decode buckets, each multi-step: with the text step, MD3 compiles a text step and a full step for each)
# and a cold compile cache, text_steps on (the default), then off if time is left.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc\|^W1\|^I1'
export PYTHONPATH=$PWD
X=/tmp/x22; mkdir -p $X
save() { tar czf $OUT/22_all.tgz -C /tmp x22; }
for T in True False; do
  [ $SECONDS -gt 280 ] && { echo "skip text_steps=$T ($SECONDS s)"; continue; }
  timeout $((585 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights --workloads startup \
    --engine-args runner.text_steps=$T --compile-cache /tmp/cs_$T --out $X/22_startup_md3_$T.json \
    2>&1 | grep -v "$FILT" > $X/22_startup_md3_$T.log
  echo "md3 startup text_steps=$T ($SECONDS s): $(grep -o "engine ready: .\{0,160\}" $X/22_startup_md3_$T.log)"
  grep -i "error\|start failed" $X/22_startup_md3_$T.log | head -3; save
done
