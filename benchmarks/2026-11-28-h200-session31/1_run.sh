# Session 31, call 1 (H200): the two things session 30 built and CPU-tested without a GPU:
# KESTREL_JAX_PIN_INPUTS=1 (each step reads its host inputs through one copy kernel, so that under
# SKIP_TEMP one graph node, not every layer's reads, is updated per call) and warmup_runs=2 (no
# graph built while serving). (a) correctness: check_mixed_step MD3 digests with PIN 0 and 1 must
# be identical; gpu_smoke tiny with PIN=1 (reference vs Pallas outputs equal). (b) MD2 W2 C=64
# A/B/A/B PIN 0/1 (cold, then warm compile caches); the last run with a trace (command-buffer
# updates per program; graph initializations while serving).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/1_env.txt
for v in 0 1; do
  KESTREL_JAX_PIN_INPUTS=$v timeout 110 python3 tools/check_mixed_step.py --model md3 --compile-cache /tmp/ccm$v \
    --out $OUT/x/1_mixed_$v.json 2>&1 | grep -v "$FILT" > $OUT/x/1_mixed_$v.log
  echo "mixed $v ($SECONDS s): $(tail -1 $OUT/x/1_mixed_$v.log | cut -c1-300)"
done
KESTREL_JAX_PIN_INPUTS=1 timeout 90 python3 tools/gpu_smoke.py --full "" --out $OUT/x/1_smoke_tiny_pin.json \
  2>&1 | grep -v "$FILT" > $OUT/x/1_smoke_tiny_pin.log
echo "smoke ($SECONDS s): $(grep -i "equal\|FAILED" $OUT/x/1_smoke_tiny_pin.log | cut -c1-200 | tr '\n' ' ')"
W2ARGS="--concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1"
i=0
for v in 0 1 0 1; do
  i=$((i+1)); TR=""; [ $i = 4 ] && TR="--trace-dir /tmp/tr1"
  [ $i -ge 3 ] && [ $SECONDS -gt 470 ] && { echo "skip run $i (pin $v): $SECONDS s"; continue; }
  KESTREL_JAX_PIN_INPUTS=$v timeout $((570 - SECONDS)) python3 tools/benchmark.py --model md2 --random-weights \
    --compile-cache /tmp/cc_md2_$v --workloads w2 $W2ARGS $TR --out $OUT/x/1_${i}_md2_pin$v.json 2>&1 | grep -v "$FILT" > $OUT/x/1_${i}_md2_pin$v.log
  echo "run $i pin $v ($SECONDS s): $(grep "engine ready\|w2 C=64\|rror" $OUT/x/1_${i}_md2_pin$v.log | cut -c1-160 | head -3 | tr '\n' ' ')"
done
python3 - <<PY
import json, glob, os
d = "$OUT/x"
m = {v: json.load(open(f"{d}/1_mixed_{v}.json")) for v in "01" if os.path.exists(f"{d}/1_mixed_{v}.json")}
for v, r in m.items(): print("mixed pin", v, r.get("digest"), r.get("tokens_equal"))
if len(m) == 2: print("mixed digests equal pin 0/1:", m["0"].get("digest") == m["1"].get("digest"))
for f in sorted(glob.glob(f"{d}/1_*_md2_*.json")):
    r = json.load(open(f))
    print(f.split("/")[-1], "startup", json.dumps(r.get("startup"))[:300])
    if "w2" not in r or "64" not in r["w2"]: continue
    s = r["w2"]["64"]["summary"]; h = s["engine_host_s"]
    print("  w2", s["output_tok_s"], s["ttft_ms_p50"], s["ttft_ms_p90"], "dispatch", round(h["dispatch"], 2),
          "image_wait", round(h["image_wait"], 2), "launch ms", s.get("launch_ms_per_step"))
    t = r["w2"].get("trace") or {}
    if t:
        print("  busy", t.get("device_busy_fraction"))
        print("  cb", json.dumps(t.get("command_buffer_updates"))[:2500])
PY
cd $OUT && tar czf 1_all.tgz x && rm -rf x
