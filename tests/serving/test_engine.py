"""End to end on a tiny synthetic model with the real runner (CPU): the batched engine gives the
single-request reference path's greedy outputs, for mixed skills, with and without prefix-cache
hits; bad requests fail alone. The checkpoint (`ckpt`) and the engine come from conftest.py, shared
with test_server.py."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from kestrel_jax.generate import SamplingSettings
from kestrel_jax.models.image_crops import DEMO_IMAGE_PATH, ImageError
from kestrel_jax.prompts import PromptError
from kestrel_jax.reference import ReferenceMoondream
from kestrel_jax.serving.engine import InferenceEngine, Result, Stream
from kestrel_jax.serving.skills import SettingsError


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    rng = np.random.default_rng(0)
    out = []
    for i, (w, h) in enumerate([(300, 300), (500, 400)]):  # 2 and 9 crops
        p = tmp_path_factory.mktemp("img") / f"{i}.png"
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(p)
        out.append(p)
    return out


@pytest.fixture(scope="module")
def ref(ckpt: Path) -> ReferenceMoondream:
    return ReferenceMoondream.from_checkpoint(ckpt, dtype=jnp.float32, progress=False)


def _leak_free(engine: InferenceEngine) -> None:
    sched = engine._worker.scheduler
    sched.check_invariants()
    assert engine.stats["live"] == 0


def test_step_inputs_stay_committed(engine: InferenceEngine, images: list[Path]) -> None:
    """Everything the device steps are fed is committed to the device, before and after serving:
    a step whose outputs come back committed (a stream-annotated computation pins memory kinds)
    and are fed to the next step must find the same committedness it was compiled with, or the
    recompile guard fails the request."""
    from kestrel_jax.serving.engine import default_compile_threads

    runner = engine._worker.runner
    # (and the engine's compile threads, left to their default, are this machine's)
    assert engine._worker.config.compile_threads is None
    assert engine.stats["compile_threads"] == engine._worker.compile_threads == default_compile_threads()

    def committed() -> bool:
        arrays = [*runner.cache.k, *runner.cache.v, runner.cache.k_scale, runner.no_outputs,
                  *runner.lm_params, *runner.vision_params, engine._worker._no_images()]
        return all(a._committed for a in arrays)

    assert committed()
    r = asyncio.run(engine.query(images[0], "What is this?", reasoning=False,
                                 settings={"temperature": 0.0, "max_tokens": 3}))
    assert isinstance(r, Result) and committed()
    _leak_free(engine)


def test_mixed_skills_batched_equal_reference(engine: InferenceEngine, ref: ReferenceMoondream,
                                              images: list[Path]) -> None:
    a, b = images
    greedy = {"temperature": 0.0, "max_tokens": 5}
    before = dict(engine.stats["images"])  # the engine is shared with other modules

    async def run() -> list[Result]:
        rs = await asyncio.gather(
            engine.query(a, "What is this?", reasoning=False, settings=greedy),
            engine.caption(b, length="short", settings=greedy),
            engine.detect(a, "car", settings={"max_objects": 2}),
            engine.point(b, "sun", settings={"max_objects": 2}),
            engine.query(b, "How many?", reasoning=True, settings={"temperature": 0.0, "max_tokens": 3}),
            engine.query(None, "Hello there", reasoning=False, settings=greedy),
        )
        return [r for r in rs if isinstance(r, Result)]

    got = asyncio.run(run())
    s = SamplingSettings(temperature=0.0, max_tokens=5)
    want = [
        ref.query(a, "What is this?", reasoning=False, settings=s).output,
        ref.caption(b, "short", s).output,
        ref.detect(a, "car", max_objects=2).output,
        ref.point(b, "sun", max_objects=2).output,
    ]
    assert got[0].output["answer"] == want[0]
    assert got[1].output["caption"] == want[1]
    np.testing.assert_allclose([[o[k] for k in o] for o in got[2].output["objects"]],
                               [[o[k] for k in o] for o in want[2]], atol=1e-6)
    np.testing.assert_allclose([[o["x"], o["y"]] for o in got[3].output["points"]],
                               [[o["x"], o["y"]] for o in want[3]], atol=1e-6)
    r = ref.query(b, "How many?", reasoning=True, settings=SamplingSettings(temperature=0.0, max_tokens=3))
    assert got[4].output["answer"] == r.output
    assert got[4].output["reasoning"]["text"] == r.extra["reasoning"]["text"]
    t = ref.query(None, "Hello there", reasoning=False, settings=s)
    assert got[5].output["answer"] == t.output
    # the random model never emits EOS (biased lm_head): every text ran to max_tokens
    assert got[0].finish_reason == "length" and got[0].metrics.output_tokens == 5
    # the images were cropped on the device (this engine's setting), equal answers included
    after = engine.stats["images"]  # (an image encoded by an earlier test is a prefix-cache hit here)
    assert after["device_crops"] >= 1 and after["host_crops"] == before["host_crops"]
    _leak_free(engine)


def test_prompts_prefilled_while_others_decode_share_their_steps(engine: InferenceEngine, ref: ReferenceMoondream,
                                                                 images: list[Path]) -> None:
    """Requests arriving while another decodes are prefilled in mixed steps (the decoding rows of
    every skill ride in the prefill step, fed from the previous step's outputs on the device): each
    still gives the reference's output. This checks the engine's plumbing (rows, inputs, outputs);
    the random model's text barely depends on its context, so the numbers of the mixed step itself
    are checked against the separate steps in test_runner_mixed.py."""
    a, b = images
    greedy = {"temperature": 0.0, "max_tokens": 4}
    mixed, decode_rows = engine.stats["steps"]["mixed"], engine.stats["scheduler"].decode_rows
    text = np.random.default_rng(3).integers(0, 255, (330, 290, 3), dtype=np.uint8)  # uncached image

    async def run() -> tuple[Result, list[Result]]:
        long = await engine.caption(a, length="normal", stream=True,
                                    settings={"temperature": 0.0, "max_tokens": 60})
        chunks = aiter(long)  # type: ignore[arg-type]
        await anext(chunks)  # decoding now: what arrives next is prefilled beside it
        rs = await asyncio.gather(
            engine.point(b, "sun", settings={"max_objects": 2}),
            engine.detect(text, "car", settings={"max_objects": 2}),
            engine.query(text, "What?", reasoning=False, settings=greedy))
        async for _ in chunks:
            pass
        return await long.result(), [r for r in rs if isinstance(r, Result)]  # type: ignore[union-attr]

    cap, (pt, det, ans) = asyncio.run(run())
    assert engine.stats["steps"]["mixed"] >= mixed + 1
    assert engine.stats["scheduler"].decode_rows > decode_rows
    # (the random model never samples EOS: the caption runs all 60 tokens)
    assert cap.output["caption"] == ref.caption(a, "normal", SamplingSettings(temperature=0.0, max_tokens=60)).output
    np.testing.assert_allclose([[o["x"], o["y"]] for o in pt.output["points"]],
                               [[o["x"], o["y"]] for o in ref.point(b, "sun", max_objects=2).output], atol=1e-6)
    want = ref.detect(text, "car", max_objects=2).output
    np.testing.assert_allclose([[o[k] for k in o] for o in det.output["objects"]], [[o[k] for k in o] for o in want],
                               atol=1e-6)
    assert ans.output["answer"] == ref.query(text, "What?", reasoning=False,
                                             settings=SamplingSettings(temperature=0.0, max_tokens=4)).output
    _leak_free(engine)


def test_prefix_cache_hit_gives_identical_answers(engine: InferenceEngine, images: list[Path]) -> None:
    img = images[1]
    greedy = {"temperature": 0.0, "max_tokens": 4}

    async def run() -> tuple[Result, Result, Result]:
        first = await engine.query(img, "Is it red?", reasoning=False, settings=greedy)
        second = await engine.query(img, "Is it red?", reasoning=False, settings=greedy)
        other = await engine.query(img, "Is it blue?", reasoning=False, settings=greedy)
        assert isinstance(first, Result) and isinstance(second, Result) and isinstance(other, Result)
        return first, second, other

    first, second, other = asyncio.run(run())
    assert second.metrics.cached_tokens >= 730 and other.metrics.cached_tokens >= 704
    assert first.output == second.output
    _leak_free(engine)


def test_a_failed_tail_copy_drops_the_cache_and_serves_on(engine: InferenceEngine, tmp_path: Path) -> None:
    """The tail copy of a newly cached image runs right after the launch that cached it; if it
    fails, the request is unaffected, the cache's entries are dropped (the tail was not written)
    and the next query of that image prefills it again and answers the same."""
    img = tmp_path / "fresh.png"
    Image.fromarray(np.random.default_rng(7).integers(0, 255, (200, 260, 3), np.uint8)).save(img)
    runner = engine._worker.runner
    real, failed = runner.copy_pages, []

    def broken(*args: Any) -> None:
        failed.append(args)
        runner.copy_pages = real  # once
        raise RuntimeError("injected page-copy failure")

    greedy = {"temperature": 0.0, "max_tokens": 4}

    async def ask() -> Result:
        res = await engine.query(img, "Is it red?", reasoning=False, settings=greedy)
        assert isinstance(res, Result)
        return res

    runner.copy_pages = broken
    try:
        first = asyncio.run(ask())
    finally:
        runner.copy_pages = real
    second, third = asyncio.run(ask()), asyncio.run(ask())
    assert len(failed) == 1 and first.metrics.cached_tokens == 0
    assert second.metrics.cached_tokens == 0  # dropped with the cache, prefilled again
    assert third.metrics.cached_tokens >= 730 and first.output == second.output == third.output
    _leak_free(engine)


def test_images_past_the_crop_canvas_take_the_host_path(engine: InferenceEngine, ref: ReferenceMoondream) -> None:
    # This engine makes crops on the device; a side longer than the canvas (1024 px) sends the image
    # to the host's PIL crops instead, with the same answer as the reference; a 378 px image too.
    # A 9-crop image fitting the canvas is cropped on the device, same answer.
    rng = np.random.default_rng(7)
    wide = rng.integers(0, 255, (200, 1100, 3), dtype=np.uint8)
    exact = rng.integers(0, 255, (378, 378, 3), dtype=np.uint8)
    tiled = rng.integers(0, 255, (400, 500, 3), dtype=np.uint8)
    before = dict(engine.stats["images"])
    greedy = {"temperature": 0.0, "max_tokens": 4}
    for img in (wide, exact, tiled):
        r = asyncio.run(engine.query(img, "What is this?", reasoning=False, settings=greedy))
        assert isinstance(r, Result)
        want = ref.query(img, "What is this?", reasoning=False, settings=SamplingSettings(temperature=0.0,
                                                                                      max_tokens=4))
        assert r.output["answer"] == want.output
    after = engine.stats["images"]
    assert after["host_crops"] == before["host_crops"] + 2 and after["device_crops"] == before["device_crops"] + 1
    _leak_free(engine)


def test_startup_freezes_the_long_lived_objects(engine: InferenceEngine) -> None:
    # A full collection must not walk the model and the compiled steps while serving (it took
    # ~150 ms for this tiny engine before they were frozen).
    assert gc.get_freeze_count() > 10_000


def test_streaming_concatenates_to_the_answer(engine: InferenceEngine, images: list[Path]) -> None:
    async def run() -> tuple[list[str], Result]:
        stream = await engine.caption(images[0], length="normal", stream=True,
                                      settings={"temperature": 0.0, "max_tokens": 6})
        chunks = [c async for c in stream]  # type: ignore[union-attr]
        return chunks, await stream.result()  # type: ignore[union-attr]

    chunks, res = asyncio.run(run())
    assert "".join(chunks) == res.output["caption"] and len(chunks) >= 1


def test_bad_requests_fail_alone(engine: InferenceEngine, images: list[Path], tmp_path: Path) -> None:
    corrupt = tmp_path / "bad.png"
    corrupt.write_bytes(b"\x89PNG garbage")

    async def run() -> list[object]:
        calls = [
            engine.query(corrupt, "What?", settings={"max_tokens": 2}),
            engine.query(images[0], "", settings={"max_tokens": 2}),
            engine.query(images[0], "x " * 2000, settings={"max_tokens": 2}),
            engine.query(images[0], "What?", settings={"temperature": -1}),
            engine.query(images[0], "What?", settings={"top_p": 1.5}),
            engine.query(images[0], "What?", settings={"max_tokens": 0}),
            engine.query(images[0], "What?", settings={"max_tokens": 10**9}),
            engine.query(images[0], "What?", settings={"bogus": 1}),
            engine.caption(images[0], length="epic"),
            engine.query(images[0], "Fine?", reasoning=False, settings={"temperature": 0.0, "max_tokens": 3}),
        ]
        return list(await asyncio.gather(*calls, return_exceptions=True))

    out = asyncio.run(run())
    assert isinstance(out[0], ImageError)
    assert isinstance(out[1], PromptError) and isinstance(out[2], PromptError)
    for e in out[3:7]:
        assert isinstance(e, SettingsError), e
    assert "context" in str(out[6])
    assert isinstance(out[7], SettingsError) and isinstance(out[8], PromptError)
    assert isinstance(out[9], Result) and out[9].metrics.output_tokens == 3
    _leak_free(engine)


def test_demo_image_and_offline_generate(engine: InferenceEngine) -> None:
    reqs = [{"skill": "caption", "image": DEMO_IMAGE_PATH, "settings": {"max_tokens": 3}},
            {"skill": "point", "image": DEMO_IMAGE_PATH, "object": "sun", "settings": {"max_objects": 1}},
            {"skill": "query", "image": DEMO_IMAGE_PATH, "question": "", "settings": {"max_tokens": 2}}]
    out = asyncio.run(engine.generate(reqs, progress=False))
    assert isinstance(out[0], Result) and isinstance(out[1], Result)
    assert isinstance(out[2], PromptError)


def test_generate_keeps_at_most_max_in_flight_requests_submitted(engine: InferenceEngine) -> None:
    active, peak = [0], [0]
    submit = engine._submit

    async def counted(*args: Any, **kw: Any) -> Any:  # one request, from image decoding to its result
        active[0] += 1
        peak[0] = max(peak[0], active[0])
        try:
            return await submit(*args, **kw)  # waits for the request's result
        finally:
            active[0] -= 1

    reqs = [{"skill": "caption", "image": DEMO_IMAGE_PATH, "length": "short", "settings": {"max_tokens": 2}}
            for _ in range(7)]
    engine._submit = counted  # type: ignore[method-assign]
    try:
        out = asyncio.run(engine.generate(reqs, progress=False, max_in_flight=2))
        bounded = peak[0]
        peak[0] = 0
        asyncio.run(engine.generate(reqs[:4], progress=False, max_in_flight=None))
    finally:
        del engine._submit
    assert all(isinstance(r, Result) for r in out)
    assert bounded == 2 and peak[0] == 4, (bounded, peak[0])
    with pytest.raises(ValueError, match="max_in_flight"):
        asyncio.run(engine.generate(reqs, progress=False, max_in_flight=0))
    # raising instead: the first failure ends the job, the rest of the list is not run
    mixed = [*reqs[:2], {"skill": "sing", "image": DEMO_IMAGE_PATH}, *reqs[:2]]
    out = asyncio.run(engine.generate(mixed, progress=False, max_in_flight=2))
    assert isinstance(out[2], ValueError) and all(isinstance(r, Result) for i, r in enumerate(out) if i != 2)
    with pytest.raises(ValueError, match="unknown skill"):
        asyncio.run(engine.generate(mixed, progress=False, max_in_flight=1, return_exceptions=False))
    _leak_free(engine)


def test_generate_stream_yields_each_result_as_it_ends_reading_requests_lazily(engine: InferenceEngine) -> None:
    """generate_stream: every request's (index, request, result or exception) once, from a
    generator that is read only as slots free; a generator's own error ends the stream with it;
    leaving early cancels what is in flight and leaves nothing behind."""
    pulled: list[int] = []

    def reqs(n: int, bad_at: int | None = None, broken_at: int | None = None) -> Any:
        for i in range(n):
            pulled.append(i)
            if i == broken_at:
                raise OSError("the job list is unreadable")
            yield ({"skill": "sing"} if i == bad_at else
                   {"skill": "caption", "image": DEMO_IMAGE_PATH, "length": "short", "settings": {"max_tokens": 2}})

    active, peak = [0], [0]
    one = engine._one

    async def counted(r: dict[str, Any]) -> Any:
        active[0] += 1
        peak[0] = max(peak[0], active[0])
        try:
            return await one(r)
        finally:
            active[0] -= 1

    async def collect(it: Any, max_in_flight: int, stop_after: int | None = None) -> list[Any]:
        out = []
        async with contextlib.aclosing(engine.generate_stream(it, max_in_flight=max_in_flight)) as stream:
            async for item in stream:
                out.append(item)
                if stop_after is not None and len(out) == stop_after:
                    break
        return out

    engine._one = counted  # type: ignore[method-assign,assignment]
    try:
        out = asyncio.run(collect(reqs(6, bad_at=3), max_in_flight=2))
    finally:
        del engine._one
    assert peak[0] == 2, peak
    assert sorted(i for i, _, _ in out) == list(range(6))
    for i, req, res in out:
        assert isinstance(res, ValueError) if i == 3 else isinstance(res, Result)
        assert req["skill"] == ("sing" if i == 3 else "caption")
    pulled.clear()
    with pytest.raises(OSError, match="unreadable"):
        asyncio.run(collect(reqs(9, broken_at=4), max_in_flight=2))
    assert pulled == [0, 1, 2, 3, 4]
    pulled.clear()
    out = asyncio.run(collect(reqs(50), max_in_flight=3, stop_after=2))  # left early: the rest is cancelled
    assert len(out) == 2 and len(pulled) < 50  # read as slots freed, not all at once
    with pytest.raises(ValueError, match="max_in_flight"):
        asyncio.run(collect(reqs(1), max_in_flight=0))
    # the engine drains the cancellations on its own thread
    for _ in range(200):
        if engine.stats["live"] == 0:
            break
        time.sleep(0.05)
    _leak_free(engine)


def test_requests_past_the_queue_limit_are_refused_at_once(engine: InferenceEngine) -> None:
    """EngineConfig.max_queued: past running + queued requests held, a new one fails at once with
    EngineBusy (before its image is decoded) and the others are served; once they end, requests
    are taken again. The default leaves room for generate's and the batch command's windows."""
    assert engine.max_requests == engine._worker.scheduler.config.running_limit + 1024 >= 512
    req: dict[str, Any] = {"image": DEMO_IMAGE_PATH, "length": "short", "settings": {"max_tokens": 4}}
    decoded = [0]
    prepare = engine._prepare_image

    def counted(image: Any) -> Any:
        decoded[0] += 1
        return prepare(image)

    async def burst() -> list[Any]:
        return await asyncio.gather(*(engine.caption(**req) for _ in range(5)), return_exceptions=True)

    saved = engine.max_requests
    engine.max_requests, engine._prepare_image = 2, counted  # type: ignore[method-assign]
    try:
        out = asyncio.run(burst())
        assert engine.held() == 0
        again = asyncio.run(engine.caption(**req))
    finally:
        engine.max_requests = saved
        del engine._prepare_image
    assert [type(r).__name__ for r in out] == ["Result", "Result", "EngineBusy", "EngineBusy", "EngineBusy"]
    assert "max_queued" in str(out[2]) and decoded[0] == 3  # the refused images were never decoded
    assert isinstance(again, Result)
    _leak_free(engine)


def test_a_caller_that_stops_waiting_ends_its_request(engine: InferenceEngine) -> None:
    """Cancelling the task that awaits a request (a timeout, a client gone) cancels the request in
    the engine: it ends as cancelled instead of decoding its 800 tokens for nobody."""
    stats = engine._worker.scheduler.stats
    before = (stats.cancelled, stats.finished)

    async def run() -> None:
        task = asyncio.ensure_future(engine.query(None, "Tell me everything", reasoning=False,  # seconds of work
                                                  settings={"max_tokens": 800, "ignore_eos": True}))
        await asyncio.sleep(0.3)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(run())
    for _ in range(200):
        if engine.held() == 0:
            break
        time.sleep(0.02)
    assert (stats.cancelled, stats.finished) == (before[0] + 1, before[1]), (stats, before)
    _leak_free(engine)


def test_a_stream_left_early_is_cancelled(engine: InferenceEngine) -> None:
    """A stream used as an async context manager and left after its first chunk is cancelled in
    the engine (its result says so); cancel() on a finished stream changes nothing."""
    stats = engine._worker.scheduler.stats
    before = stats.cancelled
    settings = {"max_tokens": 200, "ignore_eos": True}

    async def run() -> tuple[Any, Any]:
        stream = await engine.query(None, "Tell me everything", reasoning=False, stream=True, settings=settings)
        assert isinstance(stream, Stream)
        async with stream:
            async for _ in stream:
                break
        left = await stream.result()
        done = await engine.query(None, "Hi", reasoning=False, stream=True, settings={"max_tokens": 2})
        assert isinstance(done, Stream)
        async for _ in done:
            pass
        done.cancel()  # finished already: nothing to cancel
        return left, await done.result()

    left, done = asyncio.run(run())
    assert left.finish_reason == "cancelled" and left.metrics.output_tokens < 200
    assert done.finish_reason == "length" and stats.cancelled == before + 1
    _leak_free(engine)


def test_a_stream_dropped_unfinished_is_cancelled(engine: InferenceEngine) -> None:
    """A consumer that breaks out of `async for` and keeps no reference to the stream: once the
    stream is collected its request is cancelled in the engine (pages freed), where before it
    decoded on to max_tokens for nobody. A stream still referenced is not touched."""
    stats = engine._worker.scheduler.stats
    before = stats.cancelled
    settings = {"max_tokens": 200, "ignore_eos": True}

    async def run() -> tuple[Any, Any]:
        stream = await engine.query(None, "Tell me everything", reasoning=False, stream=True, settings=settings)
        kept = await engine.query(None, "Hi", reasoning=False, stream=True, settings={"max_tokens": 6})
        assert isinstance(stream, Stream) and isinstance(kept, Stream)
        future = stream.feed.future  # the result, without holding the stream
        async for _ in stream:
            break
        del stream
        for _ in range(3):  # the abandoned iterator's aclose() runs on the loop
            await asyncio.sleep(0)
        gc.collect()
        left = await asyncio.wait_for(future, timeout=60)
        chunks = [c async for c in kept]
        return left, (chunks, await kept.result())

    left, (chunks, kept) = asyncio.run(run())
    assert left.finish_reason == "cancelled" and left.metrics.output_tokens < 200
    assert kept.finish_reason == "length" and "".join(chunks) == kept.output["answer"]
    assert stats.cancelled == before + 1
    _leak_free(engine)


def test_priority_orders_admission(engine: InferenceEngine) -> None:
    """`priority`: with every running slot taken, a request of lower priority value that arrives
    after others is admitted before them (FIFO within a priority); a running request is never
    preempted; a non-integer priority is refused."""
    sched = engine._worker.scheduler
    slots = sched.config.running_limit
    admitted: list[int] = []
    try_admit = sched._try_admit

    def recorded(w: Any, now: float) -> Any:
        seq = try_admit(w, now)
        if seq is not None:
            admitted.append(int(w.req.request_id))
        return seq

    long = {"temperature": 0.0, "max_tokens": 48, "ignore_eos": True}
    short = {"temperature": 0.0, "max_tokens": 2}

    async def run() -> list[Any]:
        blockers = [engine.query(None, "Hold a slot", reasoning=False, settings=long) for _ in range(slots)]
        late = [engine.query(None, f"Low {i}", reasoning=False, settings=short, priority=5) for i in range(3)]
        urgent = engine.query(None, "Urgent", reasoning=False, settings=short, priority=-5)
        return await asyncio.gather(*blockers, *late, urgent)

    sched._try_admit = recorded
    try:
        out = asyncio.run(run())
    finally:
        del sched._try_admit
    assert all(isinstance(r, Result) for r in out)
    ids = [r.request_id for r in out]
    low, urgent = ids[slots:slots + 3], ids[-1]
    assert admitted.index(urgent) < min(admitted.index(i) for i in low), (admitted, ids)
    assert [admitted.index(i) for i in low] == sorted(admitted.index(i) for i in low)  # FIFO among equals
    assert [o.metrics.output_tokens for o in out[:slots]] == [48] * slots  # none preempted
    with pytest.raises(SettingsError, match="priority"):
        asyncio.run(engine.query(None, "Hi", priority="high"))  # type: ignore[arg-type]
    _leak_free(engine)


def test_sampled_outputs_equal_reference_with_the_same_seed(engine: InferenceEngine, ref: ReferenceMoondream,
                                                            images: list[Path]) -> None:
    settings = {"temperature": 0.8, "top_p": 0.9, "max_tokens": 6, "seed": 1234}

    async def run() -> list[Result]:
        rs = await asyncio.gather(*(engine.query(images[0], "Describe it", reasoning=False, settings=settings)
                                    for _ in range(2)))
        return [r for r in rs if isinstance(r, Result)]

    a, b = asyncio.run(run())
    want = ref.query(images[0], "Describe it", reasoning=False,
                     settings=SamplingSettings(temperature=0.8, top_p=0.9, max_tokens=6, seed=1234))
    assert a.output["answer"] == b.output["answer"] == want.output


def test_multi_step_decode_equals_reference(engine: InferenceEngine, ref: ReferenceMoondream,
                                           images: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Answer/caption rows run 8 decode iterations per launch (EngineConfig.decode_steps) of the
    text step (no region heads, `RunnerConfig.text_steps`); the outputs are the single-step
    reference's, greedy and seeded, for lengths that are not multiples of 8 (the last launch of
    each row runs short)."""
    runner = engine._worker.runner
    chosen: list[tuple[int, bool]] = []
    real = runner.decode_region

    def spy(ints: np.ndarray, steps: int) -> bool:
        chosen.append((steps, real(ints, steps)))
        return chosen[-1][1]

    monkeypatch.setattr(runner, "decode_region", spy)
    before = engine.stats["steps"]["decode_multi"]
    sampled = {"temperature": 0.7, "top_p": 0.95, "max_tokens": 13, "seed": 77}

    async def run() -> list[Result]:
        rs = await asyncio.gather(
            engine.caption(images[0], length="normal", settings={"temperature": 0.0, "max_tokens": 19}),
            engine.query(images[1], "Why?", reasoning=False, settings=sampled),
        )
        return [r for r in rs if isinstance(r, Result)]

    cap, ans = asyncio.run(run())
    assert engine.stats["steps"]["decode_multi"] >= before + 2
    assert {c for c in chosen if c[0] > 1} == {(8, False)}  # every multi-step launch: the text step
    assert cap.output["caption"] == ref.caption(images[0], "normal",
                                                SamplingSettings(temperature=0.0, max_tokens=19)).output
    assert ans.output["answer"] == ref.query(images[1], "Why?", reasoning=False,
                                             settings=SamplingSettings(**sampled)).output  # type: ignore[arg-type]
    assert cap.metrics.output_tokens == 19 and ans.metrics.output_tokens == 13
    _leak_free(engine)


def test_requests_after_warmup_compile_nothing(engine: InferenceEngine, images: list[Path],
                                               backend_compiles: Callable[[], Any]) -> None:
    """Start-up compiles every step and every small eager op the loop uses: a request (of any
    image size within the vision buckets) triggers no XLA compilation, which would add tens of
    milliseconds to the first request's TTFT on a GPU."""
    rng = np.random.default_rng(7)

    async def run() -> list[object]:
        a = rng.integers(0, 255, (280, 310, 3), dtype=np.uint8)  # a new image: no prefix-cache hit
        b = rng.integers(0, 255, (410, 520, 3), dtype=np.uint8)
        return list(await asyncio.gather(
            engine.query(a, "What?", reasoning=False, settings={"temperature": 0.0, "max_tokens": 9}),
            engine.caption(b, length="short", settings={"temperature": 0.0, "max_tokens": 9}),
            engine.point(a, "sun", settings={"max_objects": 1})))

    with backend_compiles() as compiles:
        out = asyncio.run(run())
    assert all(isinstance(r, Result) for r in out), out
    assert compiles == [], f"{len(compiles)} compilations while serving"
    _leak_free(engine)


def test_cancel_mid_stream(engine: InferenceEngine, images: list[Path]) -> None:
    async def run() -> Result:
        stream = await engine.caption(images[0], stream=True,
                                      settings={"temperature": 0.0, "max_tokens": 250, "ignore_eos": True})
        n = 0
        async for _ in stream:  # type: ignore[union-attr]
            n += 1
            if n == 2:
                engine.cancel(stream.request_id)
        return await stream.result()  # type: ignore[union-attr]

    res = asyncio.run(run())
    assert res.finish_reason == "cancelled" and res.metrics.output_tokens < 250
    _leak_free(engine)
