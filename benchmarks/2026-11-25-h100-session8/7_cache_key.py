import hashlib, logging, sys, jax, jax.numpy as jnp
logging.basicConfig(level=logging.WARNING, format="%(name)s %(message)s")
for name in ("jax._src.compiler", "jax._src.cache_key", "jax._src.compilation_cache"):
    logging.getLogger(name).setLevel(logging.DEBUG)
jax.config.update("jax_compilation_cache_dir", "/tmp/cc3")
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from kestrel_jax.models.config import md3_config
from kestrel_jax.models.moondream import random_model
from kestrel_jax.serving.runner import Runner, RunnerConfig
from kestrel_jax.serving import batch as bt
model = random_model(md3_config(), dtype=jnp.bfloat16, fp8_experts=True, kv_scale=0.05)
r = Runner(model, RunnerConfig(num_pages=64, max_seq_len=2048, vision_buckets=(2,)), out_rows=64)
ints, floats = bt.empty_decode(1, r.max_pages_per_seq)
low = r._decode_fn(1).lower(r.lm_params, r.cache, ints, floats, r.no_outputs)
text = low.as_text()
open(sys.argv[1], "w").write(text)
print("decode text sha", hashlib.sha256(text.encode()).hexdigest()[:16], len(text), flush=True)
low.compile()
print("compiled", flush=True)
