# Session 28, call 3: call 2 put decode_steps_to_finish at C=64 7,223 / 7,391 tok/s (off: 7,282 / 7,286),
# TTFT p50 278 -> 54 ms; C=32 5,412 vs 5,212. The scheduler's step counts matched the simulation
# exactly, but the engine thread now waits for image encodings (image_wait 0.4 -> 2.7 s per run): a
# request is prefilled right after it arrives, before the vision thread has encoded its image, and the
# device then idles while the mixed step is launched. Here, with decode_steps_to_finish on:
# defer_unready_images (hold such a prefill back one short decode step) and vision_batch_wait_ms=0,
# alternated, plus the old default (both off) for reference; one compile cache.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/3_env.txt
i=0
for v in defer finish defer finish defer_wait0 off defer; do
  i=$((i+1))
  case $v in
    off) args="decode_steps_to_finish=False";;
    finish) args="";;
    defer) args="defer_unready_images=True";;
    defer_wait0) args="defer_unready_images=True vision_batch_wait_ms=0";;
  esac
  [ $SECONDS -gt 500 ] && { echo "skip run $i ($v): $SECONDS s"; continue; }
  timeout $((570 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights --compile-cache /tmp/cc_w2 \
    --workloads w2 --concurrency 64 --requests-per-client 16 \
    --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1 $args \
    --out $OUT/x/3_w2_${i}_$v.json 2>&1 | grep -v "$FILT" > $OUT/x/3_w2_${i}_$v.log
  echo "run $i $v ($SECONDS s): $(grep "output tok/s\|rror" $OUT/x/3_w2_${i}_$v.log | cut -c1-200 | head -2 | tr '\n' ' ')"
done
python3 - <<PY
import json, glob
for f in sorted(glob.glob("$OUT/x/3_w2_*.json")):
    s = json.load(open(f))["w2"]["64"]["summary"]
    h = s["engine_host_s"]; c = s["scheduler"]
    print(f.split("/")[-1], s["output_tok_s"], s["ttft_ms_p50"], s["ttft_ms_p90"], c["mean_decode_batch"], c["decode_steps"],
          c["decode_iterations"], c["mixed_steps"], c.get("deferred_prefills"), "wait", round(h["wait_outputs"], 2),
          "image_wait", round(h["image_wait"], 2), "dispatch", round(h["dispatch"], 2))
PY
cd $OUT && tar czf 3_all.tgz x && rm -rf x
