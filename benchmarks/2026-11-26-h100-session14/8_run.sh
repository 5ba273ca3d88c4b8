# Session 14, call 8: is the slow state a clock state? Call 7 saw W1 alternate between ~605 and
# ~561 tok/s within one process (whole-loop command buffers), the same two levels as the default
# set's gap. Call 4's reproduction again, with nvidia-smi sampling clocks, power and throttle
# reasons every 100 ms beside it.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
E='decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()'
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active,utilization.gpu \
  --format=csv -lms 100 > $OUT/8_smi.csv 2>&1 &
SMI=$!
timeout 200 python3 tools/probe_loaded_modules.py --compile-cache /tmp/cc8 --xla --mosaic --repeats 3 \
  --decode-buckets 2,4 8,16 --engine-args $E --out $OUT/8_probe.json 2>&1 | grep -v "$FILT" > $OUT/8_probe.log
kill $SMI
grep -h "stage {\|stage failed\|ready\|w1:" $OUT/8_probe.log | cut -c1-200
python3 - <<'PY'
import csv, os, collections
rows = list(csv.reader(open(os.environ["OUT"] + "/8_smi.csv")))
print(rows[0]); by = collections.Counter((r[1].strip(), r[5].strip()) for r in rows[1:] if len(r) > 6)
print(by.most_common(12))
PY
