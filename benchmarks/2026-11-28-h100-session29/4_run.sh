# Session 29, call 4: the shipped defaults. Importing kestrel_jax now adds
# --xla_gpu_command_buffer_update_mode=SKIP_TEMP to XLA_FLAGS (KESTREL_JAX_XLA_DEFAULTS=0 opts out),
# and the runner sizes the KV pool from the driver's memory figures when the VMM allocator keeps no
# statistics (expect 4,800 pages, as with the BFC allocator's bytes_limit). First the memory figures
# in both modes, then W2 C=64 (16 requests per client) with the defaults and opted out (both cold,
# own compile caches).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/4_env.txt
for v in 1 0; do
KESTREL_JAX_XLA_DEFAULTS=$v python3 -c "
import os, kestrel_jax, jax, jax.numpy as jnp
from kestrel_jax import xla_defaults
from kestrel_jax.serving.runner import gpu_memory_info
d = jax.devices()[0]; x = jnp.ones((1 << 30,), jnp.uint8).block_until_ready()
print('defaults=$v', xla_defaults.applied(), os.environ.get('XLA_FLAGS'), 'stats', d.memory_stats(), 'driver (free, total)', gpu_memory_info(d))
" 2>&1 | grep -v "$FILT" | tee -a $OUT/x/4_memory.txt | cut -c1-500
done
i=0
for v in 1 0; do
  i=$((i+1))
  [ $SECONDS -gt 200 ] && { echo "skip run $i ($v): $SECONDS s"; continue; }
  KESTREL_JAX_XLA_DEFAULTS=$v timeout $((395 - SECONDS)) python3 tools/benchmark.py --model md3 --random-weights \
    --compile-cache /tmp/cc_$v --workloads w2 --concurrency 64 --requests-per-client 16 \
    --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1 \
    --out $OUT/x/4_${i}_defaults$v.json 2>&1 | grep -v "$FILT" > $OUT/x/4_${i}_defaults$v.log
  echo "run $i defaults=$v ($SECONDS s): $(grep "engine ready\|output tok/s\|rror" $OUT/x/4_${i}_defaults$v.log | grep -o "num_pages': [0-9]*\|w2 C=64.*TTFT\|.*rror.*" | cut -c1-200 | tr '\n' ' ')"
done
python3 - <<PY
import json, glob
for f in sorted(glob.glob("$OUT/x/4_*.json")):
    d = json.load(open(f))
    if "w2" not in d or "64" not in d["w2"]: continue
    s = d["w2"]["64"]["summary"]; h = s["engine_host_s"]; c = s["scheduler"]
    print(f.split("/")[-1], s["output_tok_s"], s["ttft_ms_p50"], c["mean_decode_batch"], "image_wait", round(h["image_wait"], 2),
          "dispatch", round(h["dispatch"], 2), "ms/launch mixed", round(h["launch_mixed"] / c["mixed_steps"] * 1e3, 2),
          "decode", round(h["launch_decode"] / c["decode_steps"] * 1e3, 2))
PY
cd $OUT && tar czf 4_all.tgz x && rm -rf x
