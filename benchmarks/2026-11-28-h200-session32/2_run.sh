# Session 32, call 2 (H200): call 1 had MD2 W2 unchanged by admit_before_wait (9,235/9,238 vs
# 9,224/9,231; image_wait 1.3-1.6 s -> 0.08 s) and MD3 True at 8,664 (session 30's default: 8,534 on
# another machine). (a) MD3 W2 C=64 False / True / False on one compile cache, to decide the default;
# (b) MD2 W2 with runner.kv_dtype=fp8 (opt-in; MD2's default and Kestrel's MD2 KV are bf16; decode
# attention is about a third of MD2's W2 device time); (c) if time is left, MD2 W2 True with a trace.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/2_env.txt
W2="--concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1"
i=0
for mv in md3:F md3:T md3:F md2:fp8 md2:T; do
  i=$((i+1)); m=${mv%:*}; v=${mv#*:}; TR=""; C=/tmp/cc_${m}
  case $v in F) X="admit_before_wait=False";; T) X="admit_before_wait=True";; fp8) X="runner.kv_dtype=fp8"; C=/tmp/cc_${m}_fp8;; esac
  [ $i = 5 ] && { [ $SECONDS -gt 400 ] && { echo "skip run $i ($mv): $SECONDS s"; continue; }; TR="--trace-dir /tmp/tr2"; }
  timeout $((565 - SECONDS)) python3 tools/benchmark.py --model $m --random-weights --compile-cache $C \
    --workloads w2 $W2 $X $TR --out $OUT/x/2_${i}_${m}_$v.json 2>&1 | grep -v "$FILT" > $OUT/x/2_${i}_${m}_$v.log
  echo "run $i $mv ($SECONDS s): $(grep "w2 C=64\|rror" $OUT/x/2_${i}_${m}_$v.log | cut -c1-140 | head -2 | tr '\n' ' ')"
done
python3 - <<PY
import json, glob
for f in sorted(glob.glob("$OUT/x/2_*.json")):
    r = json.load(open(f))
    if "w2" not in r or "64" not in r["w2"]: continue
    s = r["w2"]["64"]["summary"]; h = s["engine_host_s"]
    print(f.split("/")[-1], "w2", s["output_tok_s"], s["ttft_ms_p50"], s["ttft_ms_p90"], "dispatch", round(h["dispatch"], 2),
          "image_wait", round(h["image_wait"], 2), "wait_outputs", round(h["wait_outputs"], 2), "early", s.get("admitted_before_wait"),
          "launch ms", s.get("launch_ms_per_step"), "startup", r.get("startup", {}).get("create_s"))
    t = r["w2"].get("trace") or {}
    if t:
        print("  busy", t.get("device_busy_fraction"), "modules", json.dumps(t.get("modules"))[:400])
        print("  idle", json.dumps(t.get("idle_gaps"))[:1500])
        print("  gaps", json.dumps(t.get("engine_thread_in_long_gaps"))[:1500])
PY
cd $OUT && tar czf 2_all.tgz x && rm -rf x
