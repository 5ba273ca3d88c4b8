# Session 28, call 2: EngineConfig.decode_steps_to_finish (new, on by default). tools/simulate_serving.py
# (the real scheduler in simulated time, cost model calibrated to call 1: device times x 0.88) put W2 at
# 7,311 tok/s with 8-iteration launches throughout (measured 7,247-7,327) and 7,563-7,630 with launches
# cut to one iteration while a row reaches its max_tokens before the launch would end and others go on
# (TTFT p50 236 -> 45 ms): a finished row's client asks again at once, and with 8-iteration launches its
# next request waits up to a launch (~50 ms) to be admitted. W2 C=64 off / on / off / on (one compile
# cache; the flag only picks between the compiled 1- and 8-iteration variants), then C=32 on / off.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/2_env.txt
i=0
for cv in 64:False 64:True 64:False 64:True 32:True 32:False; do
  i=$((i+1)); c=${cv%%:*}; v=${cv##*:}
  [ $SECONDS -gt 480 ] && { echo "skip run $i ($cv): $SECONDS s"; continue; }
  timeout $((560 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc_w2 \
    --workloads w2 --concurrency $c --requests-per-client $((1024 / c)) \
    --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1 \
      decode_steps_to_finish=$v \
    --out $OUT/x/2_w2_${i}_c${c}_$v.json 2>&1 | grep -v "$FILT" > $OUT/x/2_w2_${i}_c${c}_$v.log
  echo "run $i C=$c $v ($SECONDS s): $(grep "output tok/s\|rror" $OUT/x/2_w2_${i}_c${c}_$v.log | cut -c1-260 | head -2 | tr '\n' ' ')"
done
python3 - <<PY
import json, glob
for f in sorted(glob.glob("$OUT/x/2_w2_*.json")):
    s = json.load(open(f))["w2"]
    s = s[next(iter(s))]["summary"]
    print(f.split("/")[-1], s["output_tok_s"], s["ttft_ms_p50"], s["queue_ms_p50"], s["prefill_ms_p50"], s["scheduler"]["mean_decode_batch"],
          s["scheduler"]["decode_steps"], s["scheduler"]["decode_iterations"], s["scheduler"]["mixed_steps"])
PY
cd $OUT && tar czf 2_all.tgz x && rm -rf x
