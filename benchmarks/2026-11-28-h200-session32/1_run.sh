# Session 32, call 1 (H200): session 31 built EngineConfig.admit_before_wait (requests arriving during
# a launch are admitted before the wait for the previous step; their images queued urgent while the
# live set fits the largest decode bucket) without a GPU. A/B: MD2 W2 C=64 admit_before_wait False /
# True / False / True on one compile cache (the flag does not shape any step), then True with
# vision_batch_wait_ms=0, then MD3 True (cold) if time is left. Reading output tok/s, TTFT,
# image_wait and admitted_before_wait.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/1_env.txt
W2="--concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1"
i=0
for mv in md2:F md2:T md2:F md2:T md2:T0 md3:T; do
  i=$((i+1)); m=${mv%:*}; v=${mv#*:}
  case $v in F) X="admit_before_wait=False";; T) X="admit_before_wait=True";; T0) X="admit_before_wait=True vision_batch_wait_ms=0";; esac
  [ $i = 6 ] && [ $SECONDS -gt 330 ] && { echo "skip run $i ($mv): $SECONDS s"; continue; }
  timeout $((560 - SECONDS)) python3 tools/benchmark.py --model $m --random-weights --compile-cache /tmp/cc_${m} \
    --workloads w2 $W2 $X --out $OUT/x/1_${i}_${m}_$v.json 2>&1 | grep -v "$FILT" > $OUT/x/1_${i}_${m}_$v.log
  echo "run $i $mv ($SECONDS s): $(grep "w2 C=64\|rror" $OUT/x/1_${i}_${m}_$v.log | cut -c1-140 | head -2 | tr '\n' ' ')"
done
python3 - <<PY
import json, glob
for f in sorted(glob.glob("$OUT/x/1_*.json")):
    r = json.load(open(f))
    if "w2" not in r or "64" not in r["w2"]: continue
    s = r["w2"]["64"]["summary"]; h = s["engine_host_s"]
    print(f.split("/")[-1], "w2", s["output_tok_s"], s["ttft_ms_p50"], s["ttft_ms_p90"], "dispatch", round(h["dispatch"], 2),
          "image_wait", round(h["image_wait"], 2), "early", s.get("admitted_before_wait"), "launch ms", s.get("launch_ms_per_step"),
          "vision calls", s.get("vision_calls_by_images"))
PY
cd $OUT && tar czf 1_all.tgz x && rm -rf x
