import hashlib, sys, jax, jax.numpy as jnp
from kestrel_jax.models.config import md3_config
from kestrel_jax.models.moondream import random_model
from kestrel_jax.serving.runner import Runner, RunnerConfig
from kestrel_jax.serving import batch as bt
from jax._src.lib.mlir import ir
model = random_model(md3_config(), dtype=jnp.bfloat16, fp8_experts=True, kv_scale=0.05)
r = Runner(model, RunnerConfig(num_pages=64, max_seq_len=2048, vision_buckets=(2,)), out_rows=64)
ints, floats = bt.empty_decode(1, r.max_pages_per_seq)
low = r._decode_fn(1).lower(r.lm_params, r.cache, ints, floats, r.no_outputs)
m = low.compiler_ir("stablehlo")
rows = []
def walk(op):
    o = op.operation if hasattr(op, "operation") else op
    if o.name == "stablehlo.custom_call":
        tgt = ir.StringAttr(o.attributes["call_target_name"]).value
        attrs = {}
        for i in range(len(o.attributes)):
            na = o.attributes[i]
            attrs[na.name] = str(na.attr)
        rows.append((tgt, {k: hashlib.sha256(v.encode()).hexdigest()[:10] for k, v in attrs.items()}, attrs))
    return ir.WalkResult.ADVANCE
m.operation.walk(walk)
with open(sys.argv[1], "w") as f:
    for i, (t, h, a) in enumerate(rows):
        f.write(f"{i} {t} {h}\n")
print(len(rows), "custom calls")
if len(sys.argv) > 2:
    with open(sys.argv[2], "w") as f:
        for i, (t, h, a) in enumerate(rows):
            f.write(f"=== {i} {t}\n")
            for k, v in a.items():
                f.write(f"{k}: {v[:3000]}\n")
