"""The step-input copy kernel (`pallas/pin_inputs.py`, interpreted here) returns its inputs bit for
bit through one launch, and the steps take it only when asked (KESTREL_JAX_PIN_INPUTS=1, kernel
path)."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from kestrel_jax.pallas import ops
from kestrel_jax.pallas.pin_inputs import BLOCK, copy_words, pin


def _pallas_calls(jaxpr: jax.extend.core.ClosedJaxpr) -> list[str]:
    """Names of the Pallas calls in a jaxpr and the jaxprs nested in it (jit, scan, ...)."""
    names = []

    def walk(j: jax.extend.core.Jaxpr) -> None:
        for eqn in j.eqns:
            if eqn.primitive.name == "pallas_call":
                names.append(str(eqn.params.get("name_and_src_info", "")))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    return names


def _inputs(rng: np.random.Generator) -> list[jax.Array | None]:
    """A decode step's kind of inputs: ragged shapes, negative ints, non-finite floats, a None."""
    ints = rng.integers(-(2**31), 2**31 - 1, (7, 45), dtype=np.int64).astype(np.int32)
    floats = rng.standard_normal((7, 9)).astype(np.float32)
    floats[0, :3] = [np.nan, np.inf, -0.0]
    seeds = rng.integers(0, 2**32 - 1, (5,), dtype=np.uint64).astype(np.uint32)
    return [jnp.asarray(ints), None, jnp.asarray(floats), jnp.asarray(seeds), jnp.zeros((0, 6), jnp.float32)]


def test_pin_returns_every_input_bit_for_bit() -> None:
    arrays = _inputs(np.random.default_rng())
    got = jax.jit(lambda *a: pin(a, interpret=True))(*arrays)
    assert len(got) == len(arrays) and got[1] is None
    for a, g in zip(arrays, got, strict=True):
        if a is None:
            continue
        assert g is not None and g.shape == a.shape and g.dtype == a.dtype
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(a).view(np.uint8))


def test_pin_is_one_kernel_launch_and_rejects_other_dtypes() -> None:
    arrays = _inputs(np.random.default_rng(1))
    assert len(_pallas_calls(jax.make_jaxpr(lambda *a: pin(a, interpret=True))(*arrays))) == 1
    with pytest.raises(ValueError, match="pin takes"):
        pin([jnp.zeros((4,), jnp.bfloat16)], interpret=True)
    with pytest.raises(ValueError, match="multiples"):
        copy_words(jnp.zeros((BLOCK + 1,), jnp.int32), interpret=True)
    assert pin([None, None]) == [None, None]


def test_copy_words_over_several_programs() -> None:
    words = jnp.asarray(np.random.default_rng().integers(-(2**31), 2**31 - 1, 3 * BLOCK, dtype=np.int64)
                        .astype(np.int32))
    np.testing.assert_array_equal(np.asarray(copy_words(words, interpret=True)), np.asarray(words))


@pytest.mark.parametrize(("backend", "switch", "kernels"), [("reference", "1", 0), ("kernel", "0", 0),
                                                            ("kernel", "1", 1)])
def test_steps_pin_only_when_asked(backend: str, switch: str, kernels: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The page-copy step as the runner jits it: one copy kernel only on the kernel path with the
    switch on (the decode, prefill and mixed steps call the same `ops.pin_inputs`)."""
    from kestrel_jax.models.text import KVCache
    from kestrel_jax.serving.runner import _copy_pages

    monkeypatch.setenv("KESTREL_JAX_PIN_INPUTS", switch)
    pages = jnp.zeros((4, 2, 1, 8), jnp.float32)
    cache = KVCache((pages,), (pages,), jnp.ones((1,)), jnp.ones((1,)))
    copies = jnp.asarray([[0, 3], [-1, -1]], jnp.int32)
    jaxpr = jax.make_jaxpr(lambda c, x: _copy_pages(c, x, backend=backend))(cache, copies)
    assert len(_pallas_calls(jaxpr)) == kernels
    with ops.use_backend("kernel"):  # ops.pin_inputs itself: identity with the switch off
        monkeypatch.setenv("KESTREL_JAX_PIN_INPUTS", "0")
        assert ops.pin_inputs(copies, None) == (copies, None)


def test_pin_lowers_for_an_h100() -> None:
    """At a mixed step's input sizes (2048 token rows, 64 decode rows, 32-page tables)."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    sds = jax.ShapeDtypeStruct
    shapes = [sds((2048, 8), jnp.int32), sds((2048, 2), jnp.float32), sds((8, 44), jnp.int32),
              sds((8, 2), jnp.float32), sds((64, 50), jnp.int32), sds((64, 8), jnp.float32), sds((72, 6), jnp.float32)]
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(lambda *a: pin(a)).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
