# Session 27, call 2: where W2's idle device time goes. Call 1: the GIL switch interval (0.5 vs 5 ms)
# and defer_unready_images did not move W2 (6,347-6,765 tok/s either way). (1) W2 with a 2 s trace:
# the engine thread's host ranges in the device's idle gaps >= 1 ms (engine_thread_in_long_gaps, from
# the new kestrel_jax.* annotations) and the dispatch phase split (launch_* / image_wait / copy_pages);
# the .xplane.pb comes back. (2) The probe's launch time (until the step call returns) beside the
# kernel sum, for the mixed step and decode K=1 / K=8 at B=64.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/2_env.txt
timeout 300 python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc_w2 \
  --workloads w2 --concurrency 64 --requests-per-client 16 --trace-dir /tmp/tr \
  --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1 \
  --out $OUT/x/2_w2.json 2>&1 | grep -v "$FILT" > $OUT/x/2_w2.log
echo "w2 ($SECONDS s): $(grep "output tok/s\|idle gaps\|rror" $OUT/x/2_w2.log | cut -c1-400 | head -4)"
python3 - <<PY
import json
d = json.load(open("$OUT/x/2_w2.json"))
print("host_s", d["w2"]["64"]["summary"]["engine_host_s"])
t = d["w2"].get("trace") or {}
print("busy", t.get("device_busy_fraction"), "steps", t.get("engine_steps"))
print(json.dumps(t.get("engine_thread_in_long_gaps"), indent=0)[:3000])
print(json.dumps((t.get("idle_gaps") or {}).get("long_by_module"), indent=0)[:1500])
PY
f=$(find /tmp/tr/w2 -name "*.xplane.pb" | head -1); ls -la $f; cp $f $OUT/x/2_w2.xplane.pb
for k in "mixed --steps 1" "decode --steps 1" "decode --steps 8"; do
  [ $SECONDS -gt 480 ] && { echo "skip probe $k: $SECONDS s"; continue; }
  n=$(echo $k | tr -d ' -')
  timeout $((590 - SECONDS)) python3 tools/probe_step_kernels.py --kernels 12 --top 8 --model md3 --kinds $k \
    --wall-rounds 10 --json $OUT/x/2_probe_$n.json 2>&1 | grep -v "$FILT" > $OUT/x/2_probe_$n.log
  echo "probe $k ($SECONDS s): $(grep "launches (" $OUT/x/2_probe_$n.log | head -2)"; grep -i "Traceback\|Error" $OUT/x/2_probe_$n.log | head -3
done
cd $OUT && tar czf 2_all.tgz --exclude=2_w2.xplane.pb x && mv x/2_w2.xplane.pb . && rm -rf x
