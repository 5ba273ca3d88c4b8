"""EngineConfig.decode_steps_to_finish: while a decoding row would reach its max_tokens inside a
multi-step launch and another row goes on, the engine launches one iteration at a time; off, the
launch runs its full count with the finished row idle. The answers (forced to full length) are the
same token for token either way (the reference comparison of multi-step decode is in test_engine)."""

from __future__ import annotations

import asyncio

import jax.numpy as jnp

from kestrel_jax.models.config import tiny_config
from kestrel_jax.models.moondream import random_model
from kestrel_jax.serving.engine import EngineConfig, InferenceEngine, Result
from kestrel_jax.serving.plan import DecodePlan
from kestrel_jax.serving.runner import RunnerConfig
from kestrel_jax.tokenizer import Tokenizer, build_synthetic_tokenizer


def _serve(on: bool) -> tuple[Result, Result, list[tuple[int, list[int]]]]:
    model = random_model(tiny_config("md2", vision_layers=2), dtype=jnp.float32, seed=17)
    tok = Tokenizer(build_synthetic_tokenizer(model.cfg.text.vocab_size))
    # decode buckets (1, 4), as the other MD2 engine tests': their one-iteration decode, prefill and
    # mixed programs are loads from the run's compile cache (the two rows pad to 4 instead of 2)
    cfg = EngineConfig(runner=RunnerConfig(num_pages=64, kv_dtype="f32", max_seq_len=1024, vision_buckets=(2,)),
                       decode_buckets=(1, 4), prefill_token_buckets=(1024,), max_prefill_seqs=2, decode_steps=4,
                       vision_thread=False, decode_steps_to_finish=on)
    plans: list[tuple[int, list[int]]] = []  # decode launches: (iterations, each row's iterations)
    long = {"temperature": 0.0, "max_tokens": 30, "ignore_eos": True}
    short = {"temperature": 0.0, "max_tokens": 7, "ignore_eos": True}

    async def run() -> tuple[object, object]:
        eng = await InferenceEngine.create(cfg, model=model, tokenizer=tok)
        sched = eng._worker.scheduler
        real = sched.schedule

        def spy(*args: object, **kw: object) -> object:
            plan = real(*args, **kw)
            if isinstance(plan, DecodePlan):
                n = plan.num_seqs
                plans.append((plan.steps, [plan.steps_of(i) for i in range(n)]))
            return plan

        sched.schedule = spy
        try:
            return tuple(await asyncio.gather(  # type: ignore[return-value]
                eng.query(None, "Tell me a story.", reasoning=False, settings=long),
                eng.query(None, "Name a color.", reasoning=False, settings=short)))
        finally:
            await eng.shutdown()

    a, b = asyncio.run(run())
    assert isinstance(a, Result) and isinstance(b, Result)
    assert a.metrics.output_tokens == 30 and b.metrics.output_tokens == 7
    return a, b, plans


def test_launches_stop_at_the_first_finish() -> None:
    answers = []
    for on in (True, False):
        a, b, plans = _serve(on)
        together = [(k, rows) for k, rows in plans if len(rows) == 2]
        assert together, plans  # the two decoded side by side
        split = [rows for k, rows in together if min(rows) < max(rows)]  # a launch outlasting one row
        singles = [rows for k, rows in together if k == 1]
        if on:
            assert not split and singles, plans
        else:
            assert split and not singles, plans
        assert any(k == 4 for k, _ in plans), plans  # multi-step launches still run where no row ends early
        answers.append((a.output, b.output))
    assert answers[0] == answers[1]
