"""bench_rows_kernel's cases on the CPU: each builds its program (one layer) and it lowers for an
abstract H100 with the kernels it names the weight bytes of, so a GPU run times what it says."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from tools import bench_rows_kernel as bench


def test_every_case_lowers_with_the_kernels_it_counts(monkeypatch: pytest.MonkeyPatch):
    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    # shapes only: the random weights are not drawn (lowering needs none)
    monkeypatch.setattr(bench, "_bf16", lambda key, shape, std: jax.ShapeDtypeStruct(shape, jnp.bfloat16))
    for name, build in bench.CASES.items():
        if "_st" in name:  # ring depths: the kernel clamps its ring to SMEM, and the same code lowers without
            continue
        f, args, wbytes = build(1)
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
        with jax.sharding.use_abstract_mesh(mesh):
            text = f.trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
        assert all(v > 0 for v in wbytes.values()), name
        launched = set(re.findall(r"(kestrel_gemv\w*)_mosaic_gpu", text))
        assert launched == set(wbytes), (name, launched)
        # MD2's pair also launches the output product's partials, the split cases only those; the others
        # only the rows kernel
        assert ("kestrel_gemv" in wbytes) == (name.startswith("md2") or "split" in name), name
        assert ("kestrel_gemv_rows" in wbytes) == ("split" not in name), name
