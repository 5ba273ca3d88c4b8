# Session 29, call 2: XLA command buffers with stable temp-buffer addresses
# (XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP: the client takes XLA's VMM allocator and
# gives each executable's temp buffer one reserved virtual range, so commands that touch only temps,
# constants and unchanged parameters are replayed without an update). Call 1's host trace: the engine
# thread spent 1.25 ms in command_buffer::update per text-step command buffer, the vision thread
# 5.9 ms per vision call. W1 + W2 C=64 (16 requests per client): SKIP_TEMP / default (both cold),
# then W2 again SKIP_TEMP / default (warm); each setting has its own compile cache.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/2_env.txt
i=0
for mw in skip:w1,w2 base:w1,w2 skip:w2 base:w2; do
  i=$((i+1)); m=${mw%%:*}; w=${mw#*:}
  [ $SECONDS -gt 470 ] && { echo "skip run $i ($mw): $SECONDS s"; continue; }
  if [ $m = skip ]; then export XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP; else unset XLA_FLAGS; fi
  timeout $((580 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc_$m \
    --workloads $w --concurrency 64 --requests-per-client 16 \
    --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1 \
    --out $OUT/x/2_${i}_$m.json 2>&1 | grep -v "$FILT" > $OUT/x/2_${i}_$m.log
  echo "run $i $mw ($SECONDS s): $(grep "output tok/s\|w1: \|rror" $OUT/x/2_${i}_$m.log | cut -c1-220 | head -3 | tr '\n' ' ')"
done
unset XLA_FLAGS
python3 - <<PY
import json, glob
for f in sorted(glob.glob("$OUT/x/2_*.json")):
    d = json.load(open(f))
    if "w1" in d: print(f.split("/")[-1], "w1", json.dumps(d["w1"])[:300])
    if "w2" not in d or "64" not in d["w2"]: continue
    s = d["w2"]["64"]["summary"]
    h = s["engine_host_s"]; c = s["scheduler"]
    print(f.split("/")[-1], s["output_tok_s"], s["ttft_ms_p50"], c["mean_decode_batch"], "wait", round(h["wait_outputs"], 2),
          "image_wait", round(h["image_wait"], 2), "dispatch", round(h["dispatch"], 2),
          {k: round(v, 2) for k, v in h.items() if k.startswith("launch")})
PY
cd $OUT && tar czf 2_all.tgz x && rm -rf x && ls -la
