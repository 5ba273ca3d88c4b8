# Session 26, call 5: W2 traced (2 s window) in both orders, to see where call 3's mixed-step gain went. Call 3: the W2 mixed step
# (two 740-token prompts + 64 decode rows) took 18,073 us with the sorted MoE units slice fastest vs
# 19,060 block fastest (-5.2%), yet call 2's W2 pair showed no change (6,782 vs 6,826 tok/s).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/5_env.txt
i=0
for o in blocks slices; do
  i=$((i+1))
  KESTREL_JAX_MOE_SORTED_ORDER=$o timeout 290 python3 tools/benchmark.py --model md3 \
    --random-weights --compile-cache /tmp/cc_w2t_$o --workloads w2 --concurrency 64 --requests-per-client 16 --trace-dir /tmp/tr_$o \
    --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1 \
    --out $OUT/x/5_w2_${i}_$o.json 2>&1 | grep -v "$FILT" > $OUT/x/5_w2_${i}_$o.log
  echo "run $i order=$o ($SECONDS s): $(grep "output tok/s\|rror" $OUT/x/5_w2_${i}_$o.log | head -3 | tr '\n' ' ')"
done
python3 - <<PY
import json, glob
for f in sorted(glob.glob("$OUT/x/5_w2_*.json")):
    d = json.load(open(f)); t = d["w2"].get("trace") or d["w2"]["64"].get("trace") or {}
    print(f.split("/")[-1], "busy", t.get("device_busy_fraction"), "gaps", str(t.get("idle_gaps"))[:300])
    for m, fam in sorted((t.get("module_families") or {}).items()):
        print("  ", m[:60], str(fam)[:600])
PY
cd $OUT && tar czf 5_all.tgz x && rm -rf x
