# Session 28, call 4: decode_steps_to_finish (on by default since call 2) on / off, again, on one machine:
# W1 (batch 1, one row: the cap never applies) with it on, then W2 C=64 on / off / on / off and C=8
# on / off (128 requests each); one compile cache (same executables throughout).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/4_env.txt
i=0
for wcv in w1:1:True w2:64:True w2:64:False w2:64:True w2:64:False w2:8:True w2:8:False; do
  i=$((i+1)); w=${wcv%%:*}; r=${wcv#*:}; c=${r%%:*}; v=${r##*:}
  [ $SECONDS -gt 360 ] && { echo "skip run $i ($wcv): $SECONDS s"; continue; }
  timeout $((440 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc_w2 \
    --workloads $w --concurrency $c --requests-per-client $((1024 / c > 16 ? 16 : 1024 / c)) \
    --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1 \
      decode_steps_to_finish=$v \
    --out $OUT/x/4_${w}_${i}_c${c}_$v.json 2>&1 | grep -v "$FILT" > $OUT/x/4_${w}_${i}_c${c}_$v.log
  echo "run $i $wcv ($SECONDS s): $(grep "output tok/s\|w1: \|rror" $OUT/x/4_${w}_${i}_c${c}_$v.log | cut -c1-200 | head -2 | tr '\n' ' ')"
done
python3 - <<PY
import json, glob
for f in sorted(glob.glob("$OUT/x/4_w2_*.json")):
    s = json.load(open(f))["w2"]
    s = s[next(iter(s))]["summary"]
    h = s["engine_host_s"]; c = s["scheduler"]
    print(f.split("/")[-1], s["output_tok_s"], s["ttft_ms_p50"], s["ttft_ms_p90"], c["mean_decode_batch"], c["decode_steps"],
          c["decode_iterations"], c["mixed_steps"], "wait", round(h["wait_outputs"], 2), "image_wait", round(h["image_wait"], 2),
          "dispatch", round(h["dispatch"], 2))
PY
cd $OUT && tar czf 4_all.tgz x && rm -rf x
