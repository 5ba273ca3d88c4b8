# Session 18, call 4 (planned in session 16, run now): Nsight Systems over both batch-1 levels in
# one process. Stages as call 2 (base / 2,4 / 6,12, where 4 of 4 processes switched to the slow
# level / 24); each stage's first W1 is one capture range (tools/probe_loaded_modules.py
# --profiler-ranges), with CUDA API calls and graph nodes traced. Compare per range: the host's
# CUDA API calls per launch (graph launches, uploads, updates, module or memory calls that appear
# only at the slow level), and per-kernel gaps inside the graphs (nsys stats, cuda_gpu_trace).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
[ -n "$NSYS" ] || { echo "no nsys on this machine"; exit 1; }
timeout 400 $NSYS profile --trace=cuda --cuda-graph-trace=node --capture-range=cudaProfilerApi \
  --capture-range-end=repeat:4 --force-overwrite=true -o /tmp/lvl python3 tools/probe_loaded_modules.py \
  --compile-cache /tmp/cc7 --decode-buckets 2,4 6,12 24 --profiler-ranges --repeats 1 --xla --mosaic \
  --engine-args $EA --out $OUT/4_probe_nsys.json 2>&1 | grep -v "$FILT" > $OUT/4_probe_nsys.log
for f in /tmp/lvl*.nsys-rep; do
  $NSYS stats -q --report cuda_api_sum,cuda_gpu_kern_sum --format csv -o /tmp/$(basename $f .nsys-rep) $f >/dev/null 2>&1
done
tar czf $OUT/4_nsys_stats.tgz /tmp/lvl*.csv 2>/dev/null
grep -h "stage {\|rror\|ready" $OUT/4_probe_nsys.log | cut -c18-200; ls -la /tmp/lvl* | head
