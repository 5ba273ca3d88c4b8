# Session 32, call 5 (H200): call 4 had two cold MD3 processes (same settings, each compiling and
# autotuning its own) part on all 3 batch-1 answers (after 182-526 characters) and 3 of 32 burst
# answers. Here both processes share one compile cache (gpu_smoke --compile-cache): the first
# compiles, the second loads the same executables; do their answers agree token for token?
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/5_env.txt
for i in 1 2; do
  timeout $((270 * i - SECONDS)) python3 tools/gpu_smoke.py --full md3 --skip-tiny --compile-cache /tmp/cc_smoke --out $OUT/x/5_smoke_$i.json 2>&1 | grep -v "$FILT" > $OUT/x/5_smoke_$i.log
  echo "smoke $i ($SECONDS s): $(grep "engine up\|FAILED\|repeated" $OUT/x/5_smoke_$i.log | cut -c1-160 | tr '\n' ' ')"
done
python3 - <<PY
import json
a, b = (json.load(open(f"$OUT/x/5_smoke_{i}.json"))["md3"]["auto"] for i in (1, 2))
for part in ("batch1", "burst"):
    oa, ob = a[part]["outputs"], b[part]["outputs"]
    same = [x == y for x, y in zip(oa, ob)]
    def prefix(x, y):
        x, y = x.get("answer", ""), y.get("answer", "")
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]: n += 1
        return n
    print(part, "identical", sum(same), "of", len(same), "common prefix chars", [prefix(x, y) for x, y in zip(oa, ob)][:32])
PY
cd $OUT && tar czf 5_all.tgz x && rm -rf x
