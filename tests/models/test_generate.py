"""The reference generation path on a tiny random model: invariances and errors."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kestrel_jax.generate import GenerationError, ReferenceGenerator, Sampler, SamplingSettings
from kestrel_jax.models.config import tiny_config
from kestrel_jax.models.moondream import MoondreamModel
from kestrel_jax.pallas import ops


@pytest.fixture(scope="module")
def model() -> MoondreamModel:
    return MoondreamModel(tiny_config("md3", vision_layers=2), dtype=jnp.float32, rngs=nnx.Rngs(3))


def _run(model: MoondreamModel, page_size: int, perm: int | None) -> tuple[list[int], np.ndarray]:
    with ops.use_backend("reference"):
        gen = ReferenceGenerator(model, page_size=page_size, page_permutation_seed=perm, max_len=1024)
        seq = gen.new_sequence()
        rng = np.random.default_rng(0)
        image = jnp.asarray(rng.normal(size=(729, 256)).astype(np.float32))
        gen.prefill_image(seq, image)
        first = gen.feed(seq, gen.embed_ids([1, 1538, 2, 400, 401, 3]))
        ids, _, seen = gen.decode_text(seq, first, SamplingSettings(max_tokens=5), stop_ids=[0], suppress=[3])
        return ids, np.stack(seen)


def test_page_size_and_page_order_do_not_change_results(model: MoondreamModel) -> None:
    ids_a, logits_a = _run(model, 64, None)
    ids_b, logits_b = _run(model, 16, 5)
    assert ids_a == ids_b
    np.testing.assert_allclose(logits_a, logits_b, rtol=1e-5, atol=1e-5)


def test_context_overflow_is_a_clear_error(model: MoondreamModel) -> None:
    with ops.use_backend("reference"):
        gen = ReferenceGenerator(model, page_size=16, max_len=32)
        seq = gen.new_sequence()
        with pytest.raises(GenerationError, match="exceeds the context"):
            gen.feed(seq, gen.embed_ids(list(range(10, 50))))


def test_token_ids_outside_vocab_are_rejected(model: MoondreamModel) -> None:
    gen = ReferenceGenerator(model, page_size=16, max_len=64)
    with pytest.raises(GenerationError, match="vocabulary"):
        gen.embed_ids([8192])


def test_sampling_settings_validation() -> None:
    for bad in (dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(max_tokens=0),
                dict(temperature=float("nan"))):
        with pytest.raises(GenerationError):
            SamplingSettings(**bad).validate()


def test_reference_sampler_keeps_only_the_nucleus_and_is_reproducible() -> None:
    logits = np.log(np.asarray([0.5, 0.3, 0.15, 0.05], np.float32))
    s = SamplingSettings(temperature=1.0, top_p=0.6, seed=7)
    sampler = Sampler(s)
    draws = [sampler(logits) for _ in range(2000)]
    # mass before token 1 is 0.5 <= 0.6 -> kept; before token 2 is 0.8 > 0.6 -> dropped.
    assert set(draws) == {0, 1}
    assert abs(np.mean(np.asarray(draws) == 0) - 0.5 / 0.8) < 0.05
    again = Sampler(s)
    assert [again(logits) for _ in range(50)] == draws[:50]  # same seed and steps: same tokens
    assert Sampler(SamplingSettings())(np.asarray([1.0, 3.0, 3.0], np.float32)) == 1  # greedy: first max
    assert Sampler(SamplingSettings())(np.asarray([1.0, 3.0, 3.0], np.float32), suppressed=[1]) == 2
