"""Shared-cache vs fresh lowering, MD3 full size, decode + prefill + mixed variants (H100, CPU cross-lowering)."""
import dataclasses, sys, time, functools
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AbstractDevice, AbstractMesh, AxisType
from flax import nnx
from kestrel_jax.models.config import md3_config, md2_config
from kestrel_jax.models.moondream import abstract_model
from kestrel_jax.models.text import KVCache
from kestrel_jax.pallas import lowering_cache as lc
from kestrel_jax.serving import batch as bt
from kestrel_jax.serving.runner import _Parts, _decode_step, _prefill_step, _mixed_step
assert lc.install()
S = jax.ShapeDtypeStruct
name, layers = sys.argv[1], int(sys.argv[2])
cfg = md3_config() if name == "md3" else md2_config()
cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, n_layers=layers)).validate()
model = abstract_model(cfg, fp8_experts=name == "md3")
text_gd, text_state = nnx.split(model.text)
region_gd, region_state = nnx.split(model.region)
params, treedef = jax.tree.flatten((text_state, region_state))
params = [S(p.shape, p.dtype) for p in params]
parts = _Parts(cfg, jnp.bfloat16, text_gd, region_gd, treedef)
t = cfg.text
kvd = jnp.float8_e4m3fn if name == "md3" else jnp.bfloat16
kv = tuple(S((2048, t.n_kv_heads, 64, t.head_dim), kvd) for _ in range(t.n_layers))
cache = KVCache(kv, kv, S((t.n_layers,), jnp.float32), S((t.n_layers,), jnp.float32))
mesh = AbstractMesh((1,), ("x",), (AxisType.Auto,), abstract_device=AbstractDevice(
    device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"))
sds = lambda a: S(a.shape, a.dtype)
OUT = 72
def lower(spec):
    kind, *rest = spec.split(":")
    if kind == "d":
        B, steps, region = int(rest[0]), int(rest[1]), rest[2] == "full"
        ints, floats = bt.empty_decode(B, 64)
        fn = functools.partial(_decode_step, parts, backend="kernel", out_rows=OUT, steps=steps, region=region)
        args = (sds(ints), sds(floats), S((OUT, 6), jnp.float32))
    else:
        T = int(rest[0])
        pre = [sds(a) for a in bt.empty_prefill(T, 4, 64)]
        img = S((1, 729, t.dim), jnp.bfloat16)
        if kind == "p":
            fn = functools.partial(_prefill_step, parts, backend="kernel", out_rows=OUT)
            args = (*pre, img)
        else:
            ints, floats = bt.empty_decode(64, 64)
            fn = functools.partial(_mixed_step, parts, backend="kernel", out_rows=OUT)
            args = (sds(ints), sds(floats), S((OUT, 6), jnp.float32), *pre, img)
    t0 = time.perf_counter()
    with jax.sharding.use_abstract_mesh(mesh):
        low = jax.jit(fn).trace(params, cache, *args).lower(lowering_platforms=("cuda",))
    return time.perf_counter() - t0, low.as_text()
specs = sys.argv[3:]
shared = {}
tot = 0
for s in specs:
    dt, shared[s] = lower(s); tot += dt
    print(f"shared {s}: {dt:.1f} s {lc.stats()}", flush=True)
print(f"shared total {tot:.1f} s")
tot = 0
for s in specs:
    lc.clear()
    dt, fresh = lower(s); tot += dt
    print(f"fresh {s}: {dt:.1f} s; equal: {fresh == shared[s]}", flush=True)
print(f"fresh total {tot:.1f} s")
