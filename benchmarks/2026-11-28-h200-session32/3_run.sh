# Session 32, call 3 (H200): (a) kv_scales.calibrate and compare at full MD2 size (random weights,
# synthetic tokenizer; 4 random 378 px images x 2 questions + a caption each, 32 greedy tokens):
# time, scales, bf16-vs-FP8 answer agreement; (b) MD2 W2 C=64 with runner.kv_scales=<that file> and
# kv_dtype auto (must pick FP8 on the GPU); (c) W3 (256 eight-token queries, C=1 and 64)
# admit_before_wait off / on, MD2 bf16, for the default just changed.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/3_env.txt
timeout 240 python3 - > $OUT/x/3_1_calibrate.log 2>&1 <<'PY'
import json, time
import kestrel_jax  # noqa: F401  (XLA defaults before the backend starts)
import jax, jax.numpy as jnp, numpy as np
from kestrel_jax import kv_scales
from kestrel_jax.models.config import md2_config
from kestrel_jax.models.moondream import random_model
from kestrel_jax.tokenizer import Tokenizer, build_synthetic_tokenizer
t0 = time.perf_counter()
model = random_model(md2_config(), dtype=jnp.bfloat16)
jax.block_until_ready(jax.tree.leaves(model))
tok = Tokenizer(build_synthetic_tokenizer(model.cfg.text.vocab_size))
rng = np.random.default_rng(5)
ims = [rng.integers(0, 255, (378, 378, 3), dtype=np.uint8) for _ in range(4)]
samples = [kv_scales.Sample(im, q) for im in ims for q in ("What is in this image?", "Describe the colors.")]
samples += [kv_scales.Sample(im) for im in ims]
t1 = time.perf_counter()
cal = kv_scales.calibrate(model, tok, samples, max_tokens=32)
t2 = time.perf_counter()
kv_scales.save("/tmp/kv_md2.json", cal, model_name=model.cfg.name)
cmp = kv_scales.compare(model, tok, samples, cal.scales, max_tokens=32)
t3 = time.perf_counter()
print(json.dumps({"device": jax.devices()[0].device_kind, "model_s": round(t1 - t0, 1), "calibrate_s": round(t2 - t1, 1),
                  "compare_s": round(t3 - t2, 1), "samples": cal.samples, "positions": cal.positions,
                  "k_amax": [round(float(x), 3) for x in cal.amax[:, 0]], "v_amax": [round(float(x), 3) for x in cal.amax[:, 1]],
                  "compare": cmp}))
PY
cp /tmp/kv_md2.json $OUT/x/3_kv_md2.json 2>/dev/null
echo "calibrate ($SECONDS s): $(tail -c 1500 $OUT/x/3_1_calibrate.log)"
W2="--concurrency 64 --requests-per-client 16 --engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048 runner.vision_buckets=1"
i=1
for mv in md2:scales md2:F md2:T; do
  i=$((i+1)); m=${mv%:*}; v=${mv#*:}; C=/tmp/cc_${m}; WL=w3
  case $v in scales) X="runner.kv_scales=/tmp/kv_md2.json"; C=/tmp/cc_${m}_fp8; WL=w2;; F) X="admit_before_wait=False";; T) X="admit_before_wait=True";; esac
  [ $i -ge 3 ] && [ $SECONDS -gt 420 ] && { echo "skip run $i ($mv): $SECONDS s"; continue; }
  timeout $((560 - SECONDS)) python3 tools/benchmark.py --model $m --random-weights --compile-cache $C \
    --workloads $WL $W2 $X --out $OUT/x/3_${i}_${m}_$v.json 2>&1 | grep -v "$FILT" > $OUT/x/3_${i}_${m}_$v.log
  echo "run $i $mv ($SECONDS s): $(grep "w2 C=64\|w3 C=\|rror\|kv_dtype': '" $OUT/x/3_${i}_${m}_$v.log | grep -o "w[23] C=[0-9]*: [^;]*\|.*rror.*\|kv_dtype': '[a-z0-9_]*'" | cut -c1-200 | tr '\n' ' ')"
done
cd $OUT && tar czf 3_all.tgz x && rm -rf x
