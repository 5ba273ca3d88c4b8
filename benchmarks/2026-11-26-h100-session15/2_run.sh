# Session 15, call 2. (a) Are the slow state's launches re-recording XLA's command buffers? The
# probe of call 1 (decode_buckets=1 engine; decode variants 2,4 then 8,16 loaded) with XLA's
# command-buffer thunk logging at level 3; per stage: command-buffer executions, updates (re-records
# because an allocation's address changed) and the updated allocation counts. (b) compute-sanitizer
# memcheck over md3-short (MD3 widths, 6 text layers) with decode buckets 1-16: does any kernel of
# the steps access memory out of bounds (call 5 of session 14: CUDA_ERROR_LAUNCH_FAILED)?
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error'
export PYTHONPATH=$PWD
EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 timeout 260 python3 tools/probe_loaded_modules.py \
  --compile-cache /tmp/cc2 --decode-buckets 2,4 8,16 --xla --mosaic --engine-args $EA --out $OUT/2_probe_vlog.json > /tmp/vlog.txt 2>&1
python3 - /tmp/vlog.txt > $OUT/2_vlog_summary.txt <<'PY'
import re, sys, collections
ex = up = init = 0; allocs = collections.Counter(); since = collections.Counter()
for line in open(sys.argv[1], errors="replace"):
    if "Execute command buffer on device" in line: ex += 1
    elif "Update command buffer on device" in line:
        up += 1
        m = re.search(r"updated_allocs=(\d+)", line); allocs[m.group(1) if m else "?"] += 1
        m = re.search(r"after (\d+) executions", line); since[min(int(m.group(1)), 99) if m else -1] += 1
    elif "Initialize command buffer" in line: init += 1
    elif "stage {" in line or "engine ready" in line or "w1:" in line:
        print(line.strip()[:200]); print(f"  executions {ex} updates {up} inits {init} updated_allocs {dict(allocs.most_common(8))} executions_since_update {dict(since.most_common(8))}")
        ex = up = init = 0; allocs.clear(); since.clear()
PY
grep -v "$FILT" /tmp/vlog.txt | grep -v "command_buffer_thunk" | tail -20 > $OUT/2_probe_vlog.log
CS=/usr/local/cuda/bin/compute-sanitizer
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 300 $CS --tool memcheck --print-limit 30 \
  python3 tools/benchmark.py --model md3-short --random-weights --workloads w2 --concurrency 8 --requests-per-client 1 \
  --max-tokens 16 --warmup 0 --engine-args decode_buckets=1,2,4,8,16 prefill_token_buckets=1024 runner.vision_buckets=1 \
  "runner.vision_image_batches=()" runner.num_pages=256 --out $OUT/2_memcheck.json > /tmp/mc.txt 2>&1
echo "rc $?" >> /tmp/mc.txt
grep -v "$FILT" /tmp/mc.txt | grep -v "^=========     \|Host Frame" | tail -60 > $OUT/2_memcheck.log
grep -c "Invalid\|out of bounds" /tmp/mc.txt >> $OUT/2_memcheck.log
cat $OUT/2_vlog_summary.txt; tail -25 $OUT/2_memcheck.log | cut -c1-300
