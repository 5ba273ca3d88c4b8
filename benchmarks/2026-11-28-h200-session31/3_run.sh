# Session 31, call 3 (H200): call 2's trace (MD2 W2 C=64) had the engine thread waiting 128 ms of a
# 2 s window for image encodings while the device idled, and the vision step's command-buffer
# update at 1.7-2.0 ms per call (424 commands; the text steps' 40-140 us). Hypothesis: the vision
# encoder's cuDNN attention commands are re-recorded at every call. A/B: runner.vision_attention=xla
# (with a trace: its update cost) against the default (cuDNN), MD2 W2 C=64, cold then warm caches
# (A B A B); then MD3 W2 with xla if time is left.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/3_env.txt
W2="--concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1"
i=0
for mv in md2:xla md2:cudnn md2:xla md2:cudnn md3:xla; do
  i=$((i+1)); m=${mv%:*}; v=${mv#*:}; TR=""; [ $i = 1 ] && TR="--trace-dir /tmp/tr3"
  [ $i = 5 ] && [ $SECONDS -gt 330 ] && { echo "skip run $i ($mv): $SECONDS s"; continue; }
  timeout $((540 - SECONDS)) python3 tools/benchmark.py --model $m --random-weights --compile-cache /tmp/cc_${m}_$v \
    --workloads w2 $W2 runner.vision_attention=$v $TR --out $OUT/x/3_${i}_${m}_$v.json 2>&1 | grep -v "$FILT" > $OUT/x/3_${i}_${m}_$v.log
  echo "run $i $mv ($SECONDS s): $(grep "w2 C=64\|rror" $OUT/x/3_${i}_${m}_$v.log | cut -c1-140 | head -2 | tr '\n' ' ')"
done
python3 - <<PY
import json, glob
for f in sorted(glob.glob("$OUT/x/3_*.json")):
    r = json.load(open(f))
    if "w2" not in r or "64" not in r["w2"]: continue
    s = r["w2"]["64"]["summary"]; h = s["engine_host_s"]
    print(f.split("/")[-1], "w2", s["output_tok_s"], s["ttft_ms_p50"], s["ttft_ms_p90"], "dispatch", round(h["dispatch"], 2),
          "image_wait", round(h["image_wait"], 2), "launch ms", s.get("launch_ms_per_step"))
    t = r["w2"].get("trace") or {}
    if t:
        print("  busy", t.get("device_busy_fraction"), "modules", json.dumps(t.get("modules"))[:400])
        print("  cb", json.dumps(t.get("command_buffer_updates"))[:3000])
        print("  gaps", json.dumps(t.get("engine_thread_in_long_gaps"))[:800])
PY
cd $OUT && tar czf 3_all.tgz x && rm -rf x
