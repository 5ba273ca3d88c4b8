# Session 30, call 4 (H200): A/B of passing a prefill/mixed step its image encodings as a tuple
# (joined inside the step) against stacking them in a program of their own first (the base: this
# commit's parent's kestrel_jax and tools, carried as .base). MD2 W2 C=64 (the W2 that misses its
# target), 16 requests per client, alternating base / new, each with its own compile cache (cold,
# then warm); then MD3 W2 with the new code (cold), if time is left.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/4_env.txt
W2ARGS="--concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1"
i=0
for mv in md2:base md2:new md2:base md2:new md3:new; do
  i=$((i+1)); m=${mv%:*}; v=${mv#*:}
  [ $i -ge 3 ] && [ $SECONDS -gt $((i == 5 ? 300 : 400)) ] && { echo "skip run $i ($mv): $SECONDS s"; continue; }
  if [ $v = base ]; then R=$PWD/.base; else R=$PWD; fi
  PYTHONPATH=$R timeout $((560 - SECONDS)) python3 $R/tools/benchmark.py --model $m --random-weights \
    --compile-cache /tmp/cc_${m}_$v --workloads w2 $W2ARGS --out $OUT/x/4_${i}_${m}_$v.json 2>&1 | grep -v "$FILT" > $OUT/x/4_${i}_${m}_$v.log
  echo "run $i $mv ($SECONDS s): $(grep "w2 C=64\|rror" $OUT/x/4_${i}_${m}_$v.log | cut -c1-140 | head -2 | tr '\n' ' ')"
done
python3 - <<PY
import json, glob
for f in sorted(glob.glob("$OUT/x/4_*.json")):
    d = json.load(open(f))
    if "w2" not in d or "64" not in d["w2"]: continue
    s = d["w2"]["64"]["summary"]; h = s["engine_host_s"]
    print(f.split("/")[-1], s["output_tok_s"], s["ttft_ms_p50"], s["ttft_ms_p90"], "dispatch", round(h["dispatch"], 2),
          "image_wait", round(h["image_wait"], 2), "launch ms", s.get("launch_ms_per_step"))
PY
cd $OUT && tar czf 4_all.tgz x && rm -rf x
