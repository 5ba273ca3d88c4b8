# Session 31, call 2 (H200): (1) MD2 W2 C=64 with KESTREL_JAX_PIN_INPUTS=1 and a trace (do the
# text steps' command-buffer updates shrink to the one copy node?); (2) MD2 W2 with XLA's third
# update mode, SKIP_PROFILED; (3) MD2 W2 with the defaults (this machine's baseline); each with its
# own cold compile cache. (4) the MD3 batch-1 decode step by kernel family (probe, CUPTI) on the H200.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/2_env.txt
W2ARGS="--concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1"
run() {  # name, env assignments...
  n=$1; shift
  env "$@" timeout $((560 - SECONDS)) python3 tools/benchmark.py --model md2 --random-weights --compile-cache /tmp/cc_$n \
    --workloads w2 $W2ARGS $TR --out $OUT/x/2_$n.json 2>&1 | grep -v "$FILT" > $OUT/x/2_$n.log
  echo "$n ($SECONDS s): $(grep "engine ready\|w2 C=64\|rror" $OUT/x/2_$n.log | cut -c1-160 | head -3 | tr '\n' ' ')"
}
TR="--trace-dir /tmp/tr2" run 1_md2_pin1 KESTREL_JAX_PIN_INPUTS=1
TR="" run 2_md2_profiled XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_PROFILED
[ $SECONDS -lt 330 ] && TR="" run 3_md2_default KESTREL_JAX_PIN_INPUTS=0
[ $SECONDS -lt 470 ] && timeout $((585 - SECONDS)) python3 tools/probe_step_kernels.py --kernels 8 --top 30 --model md3 \
  --kinds decode --batch 1 --steps 1 --wall-rounds 10 --json $OUT/x/2_4_probe_md3_b1.json 2>&1 | grep -v "$FILT" > $OUT/x/2_4_probe_md3_b1.log
echo "probe ($SECONDS s): $(grep "launches (" $OUT/x/2_4_probe_md3_b1.log | head -2)"
python3 - <<PY
import json, glob
for f in sorted(glob.glob("$OUT/x/2_*_md2_*.json")):
    r = json.load(open(f))
    if "w2" not in r or "64" not in r["w2"]: continue
    s = r["w2"]["64"]["summary"]; h = s["engine_host_s"]
    print(f.split("/")[-1], "w2", s["output_tok_s"], s["ttft_ms_p50"], s["ttft_ms_p90"], "dispatch", round(h["dispatch"], 2),
          "image_wait", round(h["image_wait"], 2), "launch ms", s.get("launch_ms_per_step"))
    t = r["w2"].get("trace") or {}
    if t:
        print("  busy", t.get("device_busy_fraction"))
        print("  cb", json.dumps(t.get("command_buffer_updates"))[:3000])
PY
cd $OUT && tar czf 2_all.tgz x && rm -rf x
