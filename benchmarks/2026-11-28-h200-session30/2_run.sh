# Session 30, call 2 (H200): (a) within one process under the SKIP_TEMP default, the same three
# batch-1 requests run twice (prefix cache off) must give the same tokens (gpu_smoke); (b) W1 and
# W2 C=64 (16 requests per client) with the defaults, cold compile cache (KV pages as sized under
# the VMM allocator); (c) the same again with a warm cache (start-up) and a 2 s trace of W2.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/2_env.txt
timeout 150 python3 tools/gpu_smoke.py --full md3 --skip-tiny --out $OUT/x/2_smoke.json 2>&1 | grep -v "$FILT" > $OUT/x/2_smoke.log
echo "smoke ($SECONDS s)"; grep "engine up\|FAILED\|repeated" $OUT/x/2_smoke.log | cut -c1-250
W2ARGS="--concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1"
timeout $((480 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc_w2 \
  --workloads w1,w2 $W2ARGS --out $OUT/x/2_1_cold.json 2>&1 | grep -v "$FILT" > $OUT/x/2_1_cold.log
echo "cold ($SECONDS s): $(grep "engine ready\|output tok/s\|tok/s\|rror" $OUT/x/2_1_cold.log | grep -o "num_pages': [0-9]*\|w1.*tok/s.*\|w2 C=64.*TTFT\|.*rror.*" | cut -c1-200 | tr '\n' ' ')"
[ $SECONDS -lt 420 ] && timeout $((570 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc_w2 \
  --workloads w2 $W2ARGS --trace-dir /tmp/tr2 --out $OUT/x/2_2_warm.json 2>&1 | grep -v "$FILT" > $OUT/x/2_2_warm.log
echo "warm ($SECONDS s): $(grep "engine ready\|output tok/s\|rror" $OUT/x/2_2_warm.log | grep -o "num_pages': [0-9]*\|w2 C=64.*TTFT\|.*rror.*" | cut -c1-200 | tr '\n' ' ')"
f=$(find /tmp/tr2 -name '*.xplane.pb' | head -1); [ -n "$f" ] && gzip -c "$f" > $OUT/2_w2_warm.xplane.pb.gz
python3 - <<PY
import json, glob
for f in sorted(glob.glob("$OUT/x/2_*_*.json")):
    d = json.load(open(f))
    print(f.split("/")[-1], "startup", json.dumps(d.get("startup"))[:400])
    if "w1" in d: print("  w1", json.dumps(d["w1"].get("summary", d["w1"]))[:400])
    if "w2" not in d or "64" not in d["w2"]: continue
    s = d["w2"]["64"]["summary"]; h = s["engine_host_s"]; c = s["scheduler"]
    print("  w2", s["output_tok_s"], s["ttft_ms_p50"], s.get("ttft_ms_p90"), c["mean_decode_batch"], "image_wait", round(h["image_wait"], 2),
          "dispatch", round(h["dispatch"], 2), "launch ms", s.get("launch_ms_per_step"))
    t = d["w2"].get("trace") or {}
    print("  busy", t.get("device_busy_fraction"), json.dumps(t.get("idle_gaps", {}).get("long_by_module"))[:600])
    print("  engine", json.dumps(t.get("engine_thread_in_long_gaps"))[:1500])
PY
cd $OUT && tar czf 2_all.tgz x && rm -rf x
