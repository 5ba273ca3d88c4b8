# Session 29, call 1: where W2's device idles with decode_steps_to_finish on (the default) and off:
# W2 C=64 (16 requests per client) on / off, each followed by a 2 s jax.profiler window
# (--trace-dir; summary: idle gaps by module, the engine thread's ranges in the long gaps);
# .xplane.pb files gzipped. One compile cache (the first run compiles cold).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/1_env.txt
i=0
for v in True False True; do
  i=$((i+1))
  [ $SECONDS -gt 400 ] && { echo "skip run $i ($v): $SECONDS s"; continue; }
  timeout $((540 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc_w2 \
    --workloads w2 --concurrency 64 --requests-per-client 16 --trace-dir /tmp/tr_$i \
    --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1 \
      decode_steps_to_finish=$v \
    --out $OUT/x/1_w2_${i}_$v.json 2>&1 | grep -v "$FILT" > $OUT/x/1_w2_${i}_$v.log
  echo "run $i $v ($SECONDS s): $(grep "output tok/s\|rror" $OUT/x/1_w2_${i}_$v.log | cut -c1-200 | head -2 | tr '\n' ' ')"
  f=$(find /tmp/tr_$i -name '*.xplane.pb' | head -1); [ -n "$f" ] && gzip -c "$f" > $OUT/x/1_w2_${i}_$v.xplane.pb.gz
done
python3 - <<PY
import json, glob
for f in sorted(glob.glob("$OUT/x/1_w2_*.json")):
    d = json.load(open(f))["w2"]
    t = d.get("trace") or {}
    s = d["64"]["summary"]
    h = s["engine_host_s"]; c = s["scheduler"]
    print(f.split("/")[-1], s["output_tok_s"], s["ttft_ms_p50"], c["mean_decode_batch"], "wait", round(h["wait_outputs"], 2),
          "image_wait", round(h["image_wait"], 2), "dispatch", round(h["dispatch"], 2))
    print("  busy", t.get("device_busy_fraction"), json.dumps(t.get("idle_gaps", {}).get("long_by_module"))[:600])
    print("  engine", json.dumps(t.get("engine_thread_in_long_gaps"))[:1500])
PY
cd $OUT && tar czf 1_all.tgz x && rm -rf x && ls -la
