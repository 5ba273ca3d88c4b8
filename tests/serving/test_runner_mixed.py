"""The mixed step (a prefill that also runs one decode iteration) computes what the separate
prefill and decode steps compute: the same sampled tokens, outputs and KV contents."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from kestrel_jax.models.config import tiny_config
from kestrel_jax.models.moondream import MoondreamModel, random_model
from kestrel_jax.serving import batch as bt
from kestrel_jax.serving.runner import Runner, RunnerConfig

PAGE = 16


# Text layers: tiny_config's four less those that only repeat others (every step below compiles them
# all): two dense layers for MD2; two dense and one MoE layer (MoE from layer 2) for MD3.
LAYERS = {"md2": 2, "md3": 3}


@pytest.fixture(scope="module", params=["md3", "md2"])
def model(request: pytest.FixtureRequest) -> MoondreamModel:
    cfg = tiny_config(request.param, vision_layers=2)
    cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, n_layers=LAYERS[request.param])).validate()
    return random_model(cfg, dtype=jnp.float32, seed=11)


def _runner(model: MoondreamModel) -> Runner:
    cfg = RunnerConfig(num_pages=16, kv_dtype="f32", max_seq_len=128, page_size=PAGE, vision_buckets=(2,))
    return Runner(model, cfg, out_rows=8)


def _prefill_inputs(runner: Runner, seqs: list[tuple[int, list[int]]], t: int = 32,
                    temps: tuple[float, ...] = ()) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Text prompts (first page, tokens) as one prefill batch of 2 sequences."""
    return bt.text_prefill(seqs, tokens=t, max_seqs=2, pages=runner.max_pages_per_seq, page_size=PAGE,
                           specs=tuple(bt.RowSpec(temperature=temp, seed=100 + b) for b, temp in enumerate(temps)))


def _decode_inputs(runner: Runner, rows: list[tuple[int, int, int, int]], bucket: int = 2,
                   temps: tuple[float, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    """Decode rows (first page, position, token or -1, src or -1)."""
    specs = tuple(bt.RowSpec(temperature=temps[i] if i < len(temps) else 0.0, top_p=0.9, seed=7 + i, step=3)
                  for i in range(len(rows)))
    return bt.text_decode(rows, bucket=bucket, pages=runner.max_pages_per_seq, page_size=PAGE, specs=specs)


def _kv(runner: Runner, pages: list[int]) -> np.ndarray:
    return np.stack([np.asarray(k[np.array(pages)]) for k in (*runner.cache.k, *runner.cache.v)])


# The token feed on both models; the device-side feed (src) on MD3 only (the feed is model-independent
# host/step plumbing; CI time).
# "src+gate": with KESTREL_JAX_REGION_GATE=1 the steps pass the region heads' gate column along
# (here, off the kernel path, the gate is not applied: the outputs must not change).
@pytest.mark.parametrize(("model", "feed"), [("md3", "token"), ("md3", "src"), ("md2", "token"), ("md2", "src+gate")],
                         indirect=["model"])
def test_mixed_step_equals_separate_prefill_and_decode(model: MoondreamModel, feed: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    if feed.endswith("+gate"):
        monkeypatch.setenv("KESTREL_JAX_REGION_GATE", "1")
        feed = feed[: -len("+gate")]
    a = [1, 700, 33, 4000, 12, 9, 81, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]  # 18 tokens: crosses a page
    b, c = [1, 55, 66, 77, 88], [1, 300, 301]
    temps = (0.0, 0.8)
    outs = {}
    for mode in ("separate", "mixed"):
        runner = _runner(model)
        first = np.asarray(runner.prefill(*_prefill_inputs(runner, [(2, a), (6, b)]), jnp.zeros((1, 728, 256))))
        tok_a, tok_b = int(first[0, 0]), int(first[1, 0])
        prev = jnp.asarray(first) if feed == "src" else None
        rows = [(2, len(a), tok_a if feed == "token" else -1, 0 if feed == "src" else -1),
                (6, len(b), tok_b if feed == "token" else -1, 1 if feed == "src" else -1)]
        dec = _decode_inputs(runner, rows, temps=temps)
        pre = _prefill_inputs(runner, [(10, c)], temps=(0.5,))
        images = jnp.zeros((1, 728, 256))
        if mode == "separate":
            d_out, _ = runner.decode(*dec, prev)
            p_out = runner.prefill(*pre, images)
            got = np.concatenate([np.asarray(d_out)[0, :2], np.asarray(p_out)[:1]])
        else:
            m_out = np.asarray(runner.mixed(*dec, prev, *pre, images))
            assert (m_out[4:] == 0).all()  # rows past decode bucket + prefill batch: zero padding
            got = np.concatenate([m_out[:2], m_out[2:3]])
        outs[mode] = (got, _kv(runner, [2, 3, 6, 10]))
    (g1, kv1), (g2, kv2) = outs["separate"], outs["mixed"]
    np.testing.assert_array_equal(g1[:, 0], g2[:, 0])  # sampled tokens (greedy and sampled rows)
    np.testing.assert_allclose(g1, g2, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(kv1, kv2, rtol=1e-4, atol=1e-5)
    assert np.abs(kv1).sum() > 0


def test_mixed_step_with_padding_decode_rows_writes_nothing_for_them(model: MoondreamModel) -> None:
    runner = _runner(model)
    runner.prefill(*_prefill_inputs(runner, [(2, [1, 2, 3])]), jnp.zeros((1, 728, 256)))
    before = _kv(runner, [0, 1, 4, 5, 12, 13, 14, 15])
    dec = _decode_inputs(runner, [(2, 3, 9, -1)], bucket=4)  # one real row, three padding rows
    out = np.asarray(runner.mixed(*dec, None, *_prefill_inputs(runner, [(6, [1, 4])]), jnp.zeros((1, 728, 256))))
    np.testing.assert_array_equal(before, _kv(runner, [0, 1, 4, 5, 12, 13, 14, 15]))  # pages nobody owns
    assert np.isfinite(out).all()


@pytest.mark.parametrize(("decode", "mixed", "rows"), [((4,), (), 6), ((4,), None, 6), ((1, 4), (8,), 10)])
def test_output_rows_hold_the_widest_step(model: MoondreamModel, decode: tuple[int, ...],
                                          mixed: tuple[int, ...] | None, rows: int) -> None:
    """Every step's packed outputs have room for the decode bucket or a mixed step's decode rows plus
    its prefill sequences; a single decode bucket with mixing off included (it once failed to start)."""
    from kestrel_jax.serving.engine import EngineConfig
    from kestrel_jax.serving.loop import EngineWorker
    from kestrel_jax.tokenizer import Tokenizer, build_synthetic_tokenizer

    cfg = EngineConfig(runner=RunnerConfig(num_pages=16, kv_dtype="f32", max_seq_len=128, page_size=PAGE,
                                           vision_buckets=(2,)),
                       decode_buckets=decode, mixed_decode_buckets=mixed, prefill_token_buckets=(1024,),
                       max_prefill_seqs=2, warmup=False)
    tok = Tokenizer(build_synthetic_tokenizer(model.cfg.text.vocab_size))
    worker = EngineWorker(cfg, model, tok)
    assert worker.runner.out_rows == rows
    assert worker.scheduler.config.mixed_decode_buckets == (cfg.mixed_buckets())


@pytest.mark.parametrize("model", ["md2"], indirect=True)  # engine settings only: model-independent (CI time)
def test_light_load_budget_reaches_the_scheduler(model: MoondreamModel) -> None:
    """EngineConfig's light-load prefill budget (2048 while fewer than 16 sequences decode) is the
    scheduler's; it is dropped where the buckets end at or below it, or when switched off."""
    from kestrel_jax.serving.engine import EngineConfig
    from kestrel_jax.serving.loop import EngineWorker
    from kestrel_jax.tokenizer import Tokenizer, build_synthetic_tokenizer

    tok = Tokenizer(build_synthetic_tokenizer(model.cfg.text.vocab_size))
    runner = RunnerConfig(num_pages=16, kv_dtype="f32", max_seq_len=128, page_size=PAGE, vision_buckets=(2,))
    for buckets, light, want in [((768, 1536, 2048, 3072), 2048, 2048), ((1024,), 2048, None),
                                 ((768, 1536, 2048, 3072), None, None), ((768, 3072), 1536, 1536)]:
        cfg = EngineConfig(runner=runner, decode_buckets=(4,), prefill_token_buckets=buckets, max_prefill_seqs=2,
                           prefill_light_budget=light, warmup=False)
        sched = EngineWorker(cfg, model, tok).scheduler.config
        assert (sched.light_token_budget, sched.light_below_decoding) == (want, 16), buckets
    assert EngineConfig().light_budget() == 2048 and EngineConfig().prefill_light_below == 16
    with pytest.raises(ValueError, match="light_token_budget=512"):  # below the 730-token image prefix
        EngineWorker(EngineConfig(runner=runner, decode_buckets=(4,), prefill_token_buckets=(1024,),
                                  prefill_light_budget=512, warmup=False), model, tok)
    with pytest.raises(ValueError, match="light_below_decoding must be >= 0"):  # refused, not ignored
        EngineWorker(EngineConfig(runner=runner, decode_buckets=(4,), prefill_token_buckets=(1024,),
                                  prefill_light_below=-1, warmup=False), model, tok)


@pytest.mark.parametrize("model", ["md2"], indirect=True)  # the warm-up's fallback: model-independent (CI time)
def test_a_failed_compile_ahead_leaves_the_warm_up_to_compile(model: MoondreamModel, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from kestrel_jax.serving.engine import EngineConfig
    from kestrel_jax.serving.loop import EngineWorker
    from kestrel_jax.tokenizer import Tokenizer, build_synthetic_tokenizer

    def broken(*_: object) -> None:
        raise RuntimeError("no threads today")

    cfg = EngineConfig(runner=RunnerConfig(num_pages=16, kv_dtype="f32", max_seq_len=128, page_size=PAGE,
                                           vision_buckets=(2,)),
                       decode_buckets=(2,), decode_steps=1, prefill_token_buckets=(1024,), max_prefill_seqs=2,
                       warmup_runs=2,  # the GPU default (here, on the CPU, None means 1)
                       compile_threads=2)  # compiling ahead on threads (a 2-core machine's default: 1)
    worker = EngineWorker(cfg, model, Tokenizer(build_synthetic_tokenizer(model.cfg.text.vocab_size)))
    assert worker.warmup_runs == 2
    for runs, want in ((None, 1), (3, 3)):
        worker.config = dataclasses.replace(cfg, warmup_runs=runs)
        assert worker.warmup_runs == want  # (0 is refused at construction: test_encode_ahead.py)
    worker.config = cfg
    monkeypatch.setattr(worker.runner, "compile_ahead", broken)
    # with 2, every variant runs twice at start-up (XLA builds a step's CUDA graph at its second run)
    calls: dict[str, int] = {}

    def counting(name: str) -> Any:
        fn = getattr(worker.runner, name)

        def counted(*args: object, **kw: object) -> Any:
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kw)
        return counted

    for name in ("decode", "prefill", "mixed", "copy_pages", "encode_image", "encode_singles"):
        monkeypatch.setattr(worker.runner, name, counting(name))
    with caplog.at_level(logging.WARNING):
        worker.warmup()
    assert "one by one" in caplog.text
    assert {"decode_b2_k1", "prefill_t1024", "mixed_t1024_b2"} <= set(worker.compile_s)
    copies = len(worker.runner.copy_buckets(worker.scheduler.config.max_copies))
    assert {k: calls[k] for k in ("decode", "prefill", "mixed", "copy_pages")} == {
        "decode": 2, "prefill": 2, "mixed": 2, "copy_pages": 2 * copies}
    assert calls["encode_image"] >= 2 and calls["encode_image"] % 2 == 0
    assert calls.get("encode_singles", 0) % 2 == 0



def test_the_decode_variants_compile_first_each_alone() -> None:
    from kestrel_jax.serving.loop import compile_groups

    calls = [("decode", (1,)), ("decode", (2,)), ("prefill", (3,)), ("mixed", (4,)), ("decode", (5,))]
    decode = [calls[0], calls[1], calls[4]]
    assert compile_groups(calls, 8, True) == [(decode, 1), ([calls[2], calls[3]], 8)]
    assert compile_groups(calls, 8, False) == [(calls, 8)]
    assert compile_groups(decode, 4, True) == [(decode, 1)]  # nothing else: no empty group
    assert compile_groups(calls[2:4], 4, True) == [(calls[2:4], 4)]


@pytest.mark.parametrize("model", ["md3"], indirect=True)  # step plumbing: model-independent (CI time)
def test_steps_compute_the_same_with_their_inputs_pinned(model: MoondreamModel,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """KESTREL_JAX_PIN_INPUTS routes every step's host inputs through one copy kernel (interpreted
    here, forced on the reference path): prefill, decode (with the device-side feed), mixed and
    page-copy steps must give the same outputs and KV bit for bit as without it."""
    from kestrel_jax.pallas import ops
    from kestrel_jax.pallas.pin_inputs import pin

    a, b, c = [1, 700, 33, 4000, 12, 9, 81, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [1, 55, 66, 77, 88], [1, 300]
    results = {}
    launches: list[int] = []

    def forced(*arrays: Any) -> tuple[Any, ...]:
        launches.append(len(arrays))
        return tuple(pin(arrays, interpret=True))

    for pinned in (False, True):
        if pinned:
            monkeypatch.setattr(ops, "pin_inputs", forced)
        runner = _runner(model)
        images = jnp.zeros((1, 728, 256))
        first = np.asarray(runner.prefill(*_prefill_inputs(runner, [(2, a), (6, b)], temps=(0.0, 0.9)), images))
        rows = [(2, len(a), -1, 0), (6, len(b), -1, 1)]  # both rows fed from the prefill's outputs
        d_out, last = runner.decode(*_decode_inputs(runner, rows, temps=(0.0, 0.7)), jnp.asarray(first))
        rows = [(2, len(a) + 1, -1, 0), (6, len(b) + 1, -1, 1)]
        m_out = runner.mixed(*_decode_inputs(runner, rows, temps=(0.5, 0.0)), last,
                             *_prefill_inputs(runner, [(10, c)], temps=(0.3,)), images)
        runner.copy_pages(np.asarray([[2, 12], [-1, -1]], np.int32))
        results[pinned] = ([first, np.asarray(d_out), np.asarray(m_out)], _kv(runner, [2, 3, 6, 10, 12]))
        if pinned:  # prefill, decode, mixed (3 + 4 arrays), page copy
            assert launches == [4, 3, 7, 1]
    (o1, kv1), (o2, kv2) = results[False], results[True]
    for x, y in zip(o1, o2, strict=True):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(kv1, kv2)
    assert np.abs(kv1).sum() > 0
