"""RunnerConfig.put_inputs: the text steps' host inputs put on the device before each call. The
engine compiles every step at start-up as before (nothing compiles while serving: the recompile
guard would fail the request), and answers equal the reference, through prefill, mixed and
multi-step decode launches."""

from __future__ import annotations

import asyncio

import jax.numpy as jnp
import numpy as np

from kestrel_jax.generate import SamplingSettings
from kestrel_jax.models.config import tiny_config
from kestrel_jax.models.moondream import random_model
from kestrel_jax.reference import ReferenceMoondream
from kestrel_jax.serving.engine import EngineConfig, InferenceEngine, Result
from kestrel_jax.serving.runner import RunnerConfig
from kestrel_jax.tokenizer import Tokenizer, build_synthetic_tokenizer


def test_answers_equal_the_reference_with_inputs_put_first() -> None:
    model = random_model(tiny_config("md2", vision_layers=2), dtype=jnp.float32, seed=13)
    tok = Tokenizer(build_synthetic_tokenizer(model.cfg.text.vocab_size))
    cfg = EngineConfig(runner=RunnerConfig(num_pages=64, kv_dtype="f32", max_seq_len=1024, vision_buckets=(2,),
                                           put_inputs=True),
                       # one decode bucket: these steps (their inputs committed) are this file's own programs,
                       # and what is checked does not depend on the bucket a batch pads to
                       decode_buckets=(4,), prefill_token_buckets=(1024,), max_prefill_seqs=2, decode_steps=4,
                       vision_thread=False)  # images encoded at their prefill: they join the decoding text
    host: list[int] = []  # numpy arguments per text-step call
    img = np.random.default_rng(3).integers(0, 255, (300, 340, 3), dtype=np.uint8)
    greedy = {"temperature": 0.0, "max_tokens": 12}
    long = {"temperature": 0.0, "max_tokens": 200}  # still decoding when the image prefills

    async def run() -> tuple[object, object, object, dict[str, int]]:
        eng = await InferenceEngine.create(cfg, model=model, tokenizer=tok)
        runner = eng._worker.runner
        real = runner._guarded

        def spy(name: str, fn: object, *args: object) -> object:  # what the text steps are handed
            if name.startswith(("decode", "prefill", "mixed")):
                host.append(sum(isinstance(x, np.ndarray) for x in args))
            return real(name, fn, *args)

        runner._guarded = spy
        try:
            text = asyncio.create_task(eng.query(None, "Tell me a story.", reasoning=False, settings=long))
            while eng.stats["steps"]["decode_iterations"] == 0:  # decoding: the image prefill joins it
                await asyncio.sleep(0.01)
            image = asyncio.create_task(eng.query(img, "What is this?", reasoning=False, settings=greedy))
            again = asyncio.create_task(eng.query(img, "What is that?", reasoning=False, settings=greedy))
            out = await text, await image, await again
            return (*out, dict(eng.stats["steps"]))
        finally:
            await eng.shutdown()

    t, i, a, steps = asyncio.run(run())
    assert isinstance(t, Result) and isinstance(i, Result) and isinstance(a, Result)
    assert steps["mixed"] >= 1 and steps["decode_multi"] >= 1, steps
    assert len(host) >= sum(steps[k] for k in ("prefill", "decode")) and not any(host)  # all put first
    ref = ReferenceMoondream(model, tok)
    s = SamplingSettings(temperature=0.0, max_tokens=12)
    s200 = SamplingSettings(temperature=0.0, max_tokens=200)
    assert t.output["answer"] == ref.query(None, "Tell me a story.", reasoning=False, settings=s200).output
    assert i.output["answer"] == ref.query(img, "What is this?", reasoning=False, settings=s).output
    assert a.output["answer"] == ref.query(img, "What is that?", reasoning=False, settings=s).output
