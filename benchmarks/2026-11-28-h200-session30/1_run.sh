# Session 30, call 1 (H200): are outputs the same with the SKIP_TEMP command-buffer default
# (KESTREL_JAX_XLA_DEFAULTS=1, the default) and without it (=0)? check_mixed_step (full-size MD3,
# fixed step composition: digests must match bit for bit across the settings), then gpu_smoke
# (tiny model: reference vs Pallas engine outputs; full MD3: 3 sequential batch-1 requests,
# deterministic, and a 32-request burst, whose batch composition depends on timing).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/1_env.txt
for v in 1 0; do
  KESTREL_JAX_XLA_DEFAULTS=$v timeout 120 python3 tools/check_mixed_step.py --model md3 --compile-cache /tmp/ccm$v \
    --out $OUT/x/1_mixed_$v.json 2>&1 | grep -v "$FILT" > $OUT/x/1_mixed_$v.log
  echo "mixed $v ($SECONDS s): $(tail -1 $OUT/x/1_mixed_$v.log | cut -c1-300)"
done
KESTREL_JAX_XLA_DEFAULTS=1 timeout $((560 - SECONDS)) python3 tools/gpu_smoke.py --full md3 --out $OUT/x/1_smoke_1.json \
  2>&1 | grep -v "$FILT" > $OUT/x/1_smoke_1.log
echo "smoke 1 ($SECONDS s)"; grep "engine up\|equal\|FAILED\|batch-1\|burst" $OUT/x/1_smoke_1.log | cut -c1-250
[ $SECONDS -lt 420 ] && KESTREL_JAX_XLA_DEFAULTS=0 timeout $((570 - SECONDS)) python3 tools/gpu_smoke.py --full md3 --skip-tiny \
  --out $OUT/x/1_smoke_0.json 2>&1 | grep -v "$FILT" > $OUT/x/1_smoke_0.log
echo "smoke 0 ($SECONDS s)"; grep "engine up\|FAILED\|batch-1\|burst" $OUT/x/1_smoke_0.log | cut -c1-250
python3 - <<PY
import json, os
d = "$OUT/x"
m = {v: json.load(open(f"{d}/1_mixed_{v}.json")) for v in "10" if os.path.exists(f"{d}/1_mixed_{v}.json")}
for v, r in m.items(): print("mixed", v, r.get("digest"), r.get("tokens_equal"), r.get("kv"))
if len(m) == 2: print("mixed digests equal across settings:", m["1"]["digest"] == m["0"]["digest"])
s = {v: json.load(open(f"{d}/1_smoke_{v}.json")) for v in "10" if os.path.exists(f"{d}/1_smoke_{v}.json")}
if "1" in s and "tiny" in s["1"]: print("tiny text_equal (defaults on):", s["1"]["tiny"].get("text_equal"))
if len(s) == 2:
    for part in ("batch1", "burst"):
        try:
            a, b = s["1"]["md3"]["auto"][part]["outputs"], s["0"]["md3"]["auto"][part]["outputs"]
            print(part, "outputs equal across settings:", sum(x == y for x, y in zip(a, b)), "of", len(a))
        except Exception as e: print(part, "compare failed", e)
PY
cd $OUT && tar czf 1_all.tgz x && rm -rf x
