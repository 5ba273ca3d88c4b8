"""The asyncio inference engine: many concurrent requests, one device kept busy.

    engine = await InferenceEngine.create(EngineConfig(model_path=...))
    res = await engine.query(image, "What is in this image?", settings={"max_tokens": 64})
    stream = await engine.caption(image, stream=True)
    async for chunk in stream: ...
    res = await stream.result()
    await engine.shutdown()

The API follows Kestrel's (`query`, `caption`, `detect`, `point`, `segment`, settings dict with
temperature / top_p / max_tokens / max_objects, results with `output`, `finish_reason` and
`metrics`). Device work runs on one worker thread: schedule (host) -> run (device) -> commit
(host); see `loop.py`. Input validation happens in the caller's coroutine, so a bad request
fails alone and never reaches the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import threading
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kestrel_jax.models.device_crops import CropPlan, plan_crops
from kestrel_jax.models.image_crops import (
    ImageError,
    ImageInput,
    image_tiling,
    load_image,
    overlap_crops,
    pixels_digest,
)
from kestrel_jax.prompts import (
    Prompt,
    caption_prompt,
    default_query_reasoning,
    detect_prompt,
    point_prompt,
    query_prompt,
    segment_prompt,
)
from kestrel_jax.serving.runner import RunnerConfig
from kestrel_jax.serving.skills import Job, Settings, SettingsError, Skill


class EngineError(RuntimeError):
    """The engine is not running (shut down, or its worker failed)."""


class EngineBusy(RuntimeError):
    """The engine holds as many requests as it takes (`EngineConfig.max_queued` waiting beyond
    those running): this one is refused at once, before its image is decoded; retry later."""


@dataclass(frozen=True)
class EngineConfig:
    model_path: str | None = None  # None: the synthetic demo model
    dtype: str = "bfloat16"
    fp8_experts: bool | None = None  # None: as stored in the checkpoint
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    decode_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 48, 64)
    # Prefill step sizes in tokens. An image query is the 730-token image prefix plus its prompt: one
    # fits 768, two fit 1536 (two in the 2048 step left 28% of it padding: +4% W2 tokens/s and TTFT
    # p50 -8% on the H100 with 1536, BENCHMARKS.md, eleventh session), four fit 3072. The largest is
    # the token budget: with 3072 a step takes up to four waiting image prompts and the vision thread
    # encodes their images in one call (with 2048, two: requests then arrive, finish and are encoded
    # in pairs). 64 clients asking image queries on an H200: MD2 +3-5% output tokens/s, MD3 +2.8%,
    # TTFT p50 42 -> 69 ms (MD2) and 47 -> 78 ms (MD3); 32 clients +2.6%, but 8 clients -1.5-2.8%
    # (TTFT p50 27 -> 39 ms: hence the light-load budget below); a 4096 step (five prompts) was no
    # faster than 3072 (BENCHMARKS.md, thirty-ninth session).
    prefill_token_buckets: tuple[int, ...] = (128, 256, 768, 1024, 1536, 2048, 3072)
    # ... but while fewer than `prefill_light_below` sequences decode, a step takes at most
    # `prefill_light_budget` tokens (two image prompts; no effect where the buckets end at or below
    # it; None: the full budget always). On the H200 the full budget paid from 32 clients on and
    # cost 1.5-2.8% (and 10-14 ms of TTFT) at 8; with these values 8 clients (<= 8 decoding) get
    # the 2048 budget's plans and 32 or 64 clients (~30 or ~61 decoding) the 3072 budget's. MD2,
    # H200, against None (fortieth session): 8 clients +1.8% output tok/s, TTFT p50 40 -> 29 ms;
    # 64 clients -0.3% (one pair, within run-to-run).
    prefill_light_budget: int | None = 2048
    prefill_light_below: int = 16
    max_prefill_seqs: int = 8
    enable_prefix_cache: bool = True
    warmup: bool = True  # compile every bucket at start-up, then forbid recompiles
    # Runs of each step variant at start-up. XLA runs a command buffer's first execution op by op
    # as its own warm-up and records and instantiates the CUDA graph at the second, so with one run
    # every step built its graph at its first call while serving (an H200 trace: 26 ms of host time
    # for a mixed step's 876 commands, the device idle meanwhile). None: 2 on a GPU, 1 elsewhere
    # (no command buffers).
    warmup_runs: int | None = None
    pipeline: bool = True  # launch step N+1 before reading step N (False: read each step at once)
    # Multi-step decode: when every decoding row is a plain answer/caption row and at most
    # `multi_step_max_batch` sequences are running, one launch runs `decode_steps` iterations
    # on the device (host cost per token / decode_steps). 1 disables it.
    decode_steps: int = 8
    multi_step_max_batch: int = 64
    # A multi-step launch would keep the batch slot of a sequence that reaches its max_tokens in
    # its first iterations idle to the launch's end, and the request that takes the slot next (a
    # client asking again, or one waiting) out of the batch that long: with this on, such launches
    # run one iteration each until that sequence is out (Scheduler.steps_to_first_finish). 64
    # clients asking image queries with 128-token answers on the H100: TTFT p50 278 -> 52-68 ms, mean
    # decode batch 56 -> 61.5, output tokens/s the same (C=32: TTFT 170 -> 51 ms, +4%; BENCHMARKS.md,
    # twenty-eighth session; found with tools/simulate_serving.py).
    decode_steps_to_finish: bool = True
    max_copies: int | None = None
    # Mixed steps (continuous batching): a prefill step also runs one decode iteration of every
    # decoding sequence when they fit one of these row buckets (each compiled per prefill bucket).
    # None: one bucket, the largest decode bucket. (): off (decoding waits while prompts prefill).
    mixed_decode_buckets: tuple[int, ...] | None = None
    # Start-up compiles the decode, prefill and mixed step variants on this many threads before
    # running each once (1: one after another, as they are first run). None: half the CPU cores
    # this process may use, at most 8 (`default_compile_threads`): 8 on the 16-core GPU machines,
    # where compiling side by side shortens a cold start; 1 on a 2-core machine, where more threads
    # only contend (four engine test files, one process: 118 s with 1 thread, 135 s with 2, 144 s
    # with 8; two processes side by side: 103 s against 130 s with 8; sixty-third session).
    compile_threads: int | None = None
    # With compile_threads > 1: compile the decode variants first, one at a time, so that XLA's
    # autotuning times their kernels on an otherwise idle GPU (only a cold compile cache autotunes).
    # Beside other compiles it picked other configs for 38 of 583 fusions (H100), but batch-1 decode
    # measured the same either way on one machine (559 / 558 tok/s; BENCHMARKS.md, thirteenth
    # session): off by default, kept for A/B runs.
    decode_alone: bool = False
    # Encode each new image on a worker thread as its request arrives, so that launching the vision
    # step (hundreds of kernels, hundreds of parameter arrays) leaves the engine thread, which
    # otherwise bounds 64 concurrent image queries on the GPU machine (+5% output tokens/s, TTFT
    # p50 -10% there: BENCHMARKS.md, tenth session). Off: encoded when its prefill step is launched.
    # Requests on one image share one encoding; cached images are not encoded; at most
    # `vision_ahead` images are encoded and not yet prefilled (later arrivals wait their turn).
    vision_thread: bool = True
    vision_ahead: int = 8
    # One-crop images encoded together (RunnerConfig.vision_image_batches): the vision thread waits up
    # to this long for a full batch, unless the engine needs a queued image for a prefill sooner
    # (H100, MD3, 64 clients: mostly 4 images per call with 30 ms, TTFT p50 -20 ms; BENCHMARKS.md,
    # thirteenth session). 0: encode at once whatever is queued.
    vision_batch_wait_ms: float = 30.0
    # With the vision thread: a prefill whose image encoding is not done yet is held back and the
    # step launched without it (a one-iteration decode step when nothing else prefills), instead of
    # the engine thread waiting for the encoding while the device runs dry. A 2 s trace of 64
    # concurrent image queries on the H100 (BENCHMARKS.md, twenty-sixth session) had the device idle
    # 21-33% of the window, mostly in gaps of ~5 ms before steps. Off until measured on the GPU.
    defer_unready_images: bool = False
    # With the vision thread: requests that arrived while a step was being launched are admitted
    # before the engine thread waits for the previous step's outputs (not after), and while every
    # live request fits the largest decode bucket their images are encoded at once rather than
    # after a wait for a fuller batch: the vision thread launches the encoding while the engine
    # thread waits, instead of the engine thread waiting for that launch when it plans the prefill.
    # A W2 trace (64 clients, H200, BENCHMARKS.md, thirty-first session) had the engine thread in
    # that wait (image_wait) for 128 ms of a 2 s window with the device idle, 1.8-2.5 s per 14-15 s
    # run. Measured (H200, thirty-second session, A/B/A/B): image_wait 1.3-1.9 s -> 0.1 s per run,
    # the engine thread's dispatch time down a third, output tokens/s and TTFT unchanged (MD2
    # +0.1%, +0.1%; MD3 +0.1%): the device, not that wait, bounds W2 on that host. On by default
    # for the host time it frees (other threads: tokenizing, the HTTP server, a slower host).
    admit_before_wait: bool = True
    # Requests held beyond those running (waiting for KV pages or a batch slot, in the inbox, or
    # having their image decoded): a request past it fails at once with EngineBusy (a server answers
    # 503 "overloaded"), so a burst cannot fill host memory with decoded images and queued crops.
    # None: no limit. `generate` and the batch command submit at most their max_in_flight at a time.
    max_queued: int | None = 1024
    # Devices to serve on, one engine worker each (data parallel: each holds the whole model and its
    # own KV pool; `serving.group` routes requests, an image's queries to one device for its prefix
    # cache). 1: `runner.device` only; 0: every local device.
    num_devices: int = 1

    def mixed_buckets(self) -> tuple[int, ...]:
        if self.mixed_decode_buckets is None:
            return (max(self.decode_buckets),)
        return tuple(self.mixed_decode_buckets)

    def light_budget(self) -> int | None:
        """The scheduler's light-load token budget: `prefill_light_budget`, or None where it would
        not differ from the full budget (the largest prefill bucket)."""
        if self.prefill_light_budget is None or self.prefill_light_budget >= max(self.prefill_token_buckets):
            return None
        return self.prefill_light_budget


def default_compile_threads() -> int:
    """`EngineConfig.compile_threads` left as None: half the CPU cores this process may use, at
    most 8, at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores // 2))


def decode_buckets_up_to(max_batch_size: int) -> tuple[int, ...]:
    """The default decode buckets below `max_batch_size`, then `max_batch_size` itself."""
    if max_batch_size < 1:
        raise ValueError(f"max batch size must be >= 1, got {max_batch_size}")
    return (*(b for b in EngineConfig().decode_buckets if b < max_batch_size), max_batch_size)


@dataclass
class Metrics:
    ttft_ms: float = 0.0
    prefill_time_ms: float = 0.0
    decode_time_ms: float = 0.0
    queue_time_ms: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    tokens_per_s: float = 0.0


@dataclass
class Result:
    output: dict[str, Any]
    finish_reason: str
    metrics: Metrics
    request_id: int = 0


class StreamFeed:
    """The engine's side of a stream: the chunk queue (None ends it) and the request's future. The
    worker holds this, never the `Stream` itself, so a stream its caller has dropped can be
    collected (and its request cancelled)."""

    def __init__(self, future: asyncio.Future[Result]):
        self.queue: asyncio.Queue[str | None] = asyncio.Queue()
        self.future = future

    def push(self, chunk: str | None) -> None:
        self.queue.put_nowait(chunk)


def _abandoned(future: asyncio.Future[Result], cancel: Callable[[int], None], request_id: int) -> None:
    """A `Stream` collected before its request finished: nobody can read it any more."""
    if not future.done():
        cancel(request_id)


async def _chunks(queue: asyncio.Queue[str | None]) -> AsyncIterator[str]:
    while True:
        chunk = await queue.get()
        if chunk is None:
            return
        yield chunk


class Stream:
    """Async iterator of text chunks (answer text; reasoning is not streamed), then `result()`.
    A consumer that stops early calls `cancel()` (or uses the stream as an async context manager,
    which cancels it on exit unless it finished), so the engine stops decoding for it; its
    `result()` then has finish_reason "cancelled". A stream dropped unfinished (no reference left,
    e.g. a `break` out of `async for chunk in await engine.query(..., stream=True)`) is cancelled
    when it is collected."""

    def __init__(self, future: asyncio.Future[Result], request_id: int = 0,
                 cancel: Callable[[int], None] | None = None):
        self.feed = StreamFeed(future)
        self.request_id = request_id
        self._cancel = cancel
        if cancel is not None:  # the callback holds the future and the id, not the stream
            weakref.finalize(self, _abandoned, future, cancel, request_id).atexit = False

    def cancel(self) -> None:
        """End the request in the engine now (no-op once it finished)."""
        if self._cancel is not None and not self.feed.future.done():
            self._cancel(self.request_id)

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()

    def __aiter__(self) -> AsyncIterator[str]:
        return _chunks(self.feed.queue)  # the iterator holds the queue, not the stream

    async def result(self) -> Result:
        return await self.feed.future


@dataclass
class Submission:
    """Everything the worker needs for one request (built and validated on the caller's side)."""

    job: Job
    tokens: tuple[int, ...]  # positions after the image prefix (text-only: BOS first)
    crops: np.ndarray | CropPlan | None  # host-made crops, or the plan the device makes them from
    tiling: tuple[int, int] | None
    digest: bytes | None
    future: asyncio.Future[Result]
    loop: asyncio.AbstractEventLoop
    stream: StreamFeed | None
    arrival: float
    deadline: float | None = None
    priority: int = 0  # lower is admitted first (the scheduler's order), then arrival
    first_token_time: float | None = None  # when the host read its first output
    last_output_time: float | None = None


_ids = itertools.count(1)


class InferenceEngine:
    def __init__(self, worker: Any, tokenizer: Any, cfg: Any):
        self._worker = worker
        self.tokenizer = tokenizer
        self.cfg = cfg
        queued = worker.config.max_queued
        if queued is not None and queued < 0:
            raise ValueError(f"max_queued must be >= 0 or None, got {queued}")
        # requests the engine may hold at once (running + queued, per device); None: any number
        self.max_requests: int | None = None if queued is None else (
            (worker.scheduler.config.running_limit + queued) * getattr(worker, "size", 1))
        self._preparing = 0  # requests between their arrival and the worker's inbox (image decoding)
        self._preparing_lock = threading.Lock()

    @classmethod
    async def create(cls, config: EngineConfig | None = None, *, model: Any = None,
                     tokenizer: Any = None) -> InferenceEngine:
        """Load the model (or use `model`, a MoondreamModel already in memory), size the KV pool,
        compile every bucket and start the worker."""
        from kestrel_jax.serving.loop import EngineWorker

        config = config or EngineConfig()
        devices = _devices(config)
        if len(devices) == 1:
            config = dataclasses.replace(config, runner=dataclasses.replace(config.runner, device=devices[0]))
            worker = await asyncio.get_running_loop().run_in_executor(None, EngineWorker.start, config, model,
                                                                      tokenizer)
            return cls(worker, worker.tokenizer, worker.model.cfg)
        group = await asyncio.get_running_loop().run_in_executor(None, _start_group, config, devices, model,
                                                                 tokenizer)
        return cls(group, group.tokenizer, group.model.cfg)

    @property
    def stats(self) -> dict[str, Any]:
        return {**self._worker.stats(), "held": self.held(), "max_requests": self.max_requests}

    @property
    def healthy(self) -> bool:
        """False once the engine was shut down or its worker failed."""
        return self._worker.alive

    @property
    def max_seq_len(self) -> int:
        """Context length (prefix + prompt + generated positions) of this engine."""
        return int(self._worker.max_seq_len)

    @property
    def model(self) -> Any:
        return self._worker.model

    def cancel(self, request_id: int) -> None:
        """End a request early (waiting or running): its pages are freed and its result (or
        stream) completes with finish_reason "cancelled". Unknown ids are ignored."""
        self._worker.cancel(request_id)

    async def shutdown(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._worker.stop)

    # ------------------------------------------------------------------------------ skills
    async def query(self, image: ImageInput | None, question: str, *, reasoning: bool | None = None,
                    spatial_refs: Sequence[Any] = (), stream: bool = False,
                    settings: dict[str, Any] | None = None, deadline_s: float | None = None,
                    priority: int = 0) -> Result | Stream:
        s = Settings.from_dict(settings, skill="query")
        reasoning = default_query_reasoning(self.cfg) if reasoning is None else bool(reasoning)
        prompt = query_prompt(self.cfg, self.tokenizer.encode, question, reasoning=reasoning,
                              spatial_refs=tuple(spatial_refs), max_prompt_tokens=self._max_prompt(image))
        return await self._submit("query", image, prompt, s, reasoning, stream, deadline_s, priority)

    async def caption(self, image: ImageInput, *, length: str = "normal", stream: bool = False,
                      settings: dict[str, Any] | None = None, deadline_s: float | None = None,
                      priority: int = 0) -> Result | Stream:
        s = Settings.from_dict(settings, skill="caption")
        return await self._submit("caption", image, caption_prompt(self.cfg, length), s, False, stream, deadline_s,
                                  priority)

    async def detect(self, image: ImageInput, object: str, *, settings: dict[str, Any] | None = None,
                     deadline_s: float | None = None, priority: int = 0) -> Result:
        s = Settings.from_dict(settings, skill="detect")
        prompt = detect_prompt(self.cfg, self.tokenizer.encode, object, max_prompt_tokens=self._max_prompt(image))
        r = await self._submit("detect", image, prompt, s, False, False, deadline_s, priority)
        assert isinstance(r, Result)
        return r

    async def point(self, image: ImageInput, object: str, *, spatial_refs: Sequence[Any] = (),
                    settings: dict[str, Any] | None = None, deadline_s: float | None = None,
                    priority: int = 0) -> Result:
        s = Settings.from_dict(settings, skill="point")
        prompt = point_prompt(self.cfg, self.tokenizer.encode, object, spatial_refs=tuple(spatial_refs),
                              max_prompt_tokens=self._max_prompt(image))
        r = await self._submit("point", image, prompt, s, False, False, deadline_s, priority)
        assert isinstance(r, Result)
        return r

    async def segment(self, image: ImageInput, object: str, *, spatial_refs: Sequence[Any] = (),
                      settings: dict[str, Any] | None = None, deadline_s: float | None = None,
                      priority: int = 0) -> Result:
        """The object's outline as an SVG path and its bounding box (Moondream 3 family models;
        MOONDREAM.md §7.6): `output = {"segments": [{"svg_path", "bbox", ...}]}`, the path in [0, 1]
        of the box (`kestrel_jax.segment.segment_mask` maps it onto the image). Greedy by default;
        `max_tokens` bounds the path's length."""
        s = Settings.from_dict(settings, skill="segment")
        prompt = segment_prompt(self.cfg, self.tokenizer.encode, object, spatial_refs=tuple(spatial_refs),
                                max_prompt_tokens=self._max_prompt(image))
        r = await self._submit("segment", image, prompt, s, False, False, deadline_s, priority, subject=object)
        assert isinstance(r, Result)
        return r

    async def generate(self, requests: Sequence[dict[str, Any]], *, progress: bool = True,
                       return_exceptions: bool = True, max_in_flight: int | None = 512) -> list[Result | BaseException]:
        """Offline batch: each dict has `skill` plus that skill's arguments; results come back in
        order. At most `max_in_flight` requests are submitted at a time (the scheduler batches
        them; a new one goes in as each ends), so a job over millions of images never holds more
        than that many decoded images and queued requests (None: all at once). A failing request
        yields its exception in place (or raises, with return_exceptions=False, and the rest of
        the list is not run). `generate_stream` gives each result as it ends instead."""
        from tqdm import tqdm

        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1 or None, got {max_in_flight}")
        results: list[Result | BaseException | None] = [None] * len(requests)
        if not requests:
            return []
        n = len(requests) if max_in_flight is None else min(max_in_flight, len(requests))
        with tqdm(total=len(requests), disable=not progress, desc="generate", unit="req") as bar:
            async with contextlib.aclosing(self.generate_stream(requests, max_in_flight=n)) as done:
                async for i, _, res in done:
                    if isinstance(res, BaseException) and not return_exceptions:
                        raise res
                    results[i] = res
                    bar.update(1)
        return results  # type: ignore[return-value]

    async def generate_stream(self, requests: Iterable[dict[str, Any]], *, max_in_flight: int = 512,
                              ) -> AsyncGenerator[tuple[int, dict[str, Any], Result | BaseException], None]:
        """Offline batch, streamed: (index, request, its Result or the exception it failed with)
        as each request ends, in completion order. `requests` is read lazily, one request as a
        slot frees (a generator over millions of files is never held whole), at most
        `max_in_flight` submitted at a time. An error raised by the iterable itself ends the
        stream with it. Leaving the stream early (break, an exception, `aclose`) cancels the
        requests still in flight."""
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        todo = enumerate(requests)  # shared by the workers: each takes the next request
        ended: asyncio.Queue[tuple[int, dict[str, Any], Result | BaseException]] = asyncio.Queue()

        async def worker() -> None:  # one request at a time, from image decoding to its result
            for i, r in todo:
                try:
                    res: Result | BaseException = await self._one(r)
                except Exception as e:  # noqa: BLE001 - delivered in place
                    res = e
                await ended.put((i, r, res))

        # Workers, not one task per request: a list of millions costs at most max_in_flight tasks.
        workers = [asyncio.ensure_future(worker()) for _ in range(max_in_flight)]
        all_done: asyncio.Future[Any] = asyncio.ensure_future(asyncio.gather(*workers))
        try:
            while True:
                got: asyncio.Future[Any] = asyncio.ensure_future(ended.get())
                await asyncio.wait({got, all_done}, return_when=asyncio.FIRST_COMPLETED)
                if got.done():
                    yield got.result()
                    continue
                got.cancel()
                while not ended.empty():
                    yield ended.get_nowait()
                all_done.result()  # the iterable's own error, if it raised one
                return
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            all_done.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # retrieved: no "never retrieved" warning
                await all_done

    async def _one(self, request: dict[str, Any]) -> Result:
        """One `generate` request: its `skill` and that skill's arguments (no stream)."""
        fns: dict[str, Any] = {"query": self.query, "caption": self.caption, "detect": self.detect,
                               "point": self.point, "segment": self.segment}
        if not isinstance(request, dict):
            raise TypeError(f"a request is a dict with 'skill' and its arguments, got {type(request).__name__}")
        args = dict(request)
        skill = args.pop("skill", None)
        fn = fns.get(skill) if isinstance(skill, str) else None
        if fn is None:
            raise ValueError(f"unknown skill {skill!r}; one of {sorted(fns)}")
        args.pop("stream", None)
        res = await fn(**args)
        assert isinstance(res, Result)
        return res

    # ------------------------------------------------------------------------------ internals
    def _max_prompt(self, image: ImageInput | None) -> int:
        t = self.cfg.text
        return self.max_seq_len - (t.prefix_attn if image is not None else 1) - 1

    def held(self) -> int:
        """Requests the engine holds now: being prepared, in its inbox, waiting or running."""
        return self._preparing + self._worker.held()

    async def _submit(self, skill: Skill, image: ImageInput | None, prompt: Prompt, settings: Settings,
                      reasoning: bool, stream: bool, deadline_s: float | None, priority: int = 0,
                      subject: str = "") -> Result | Stream:
        """`priority`: lower is admitted first, FIFO within one (the scheduler's queue order); a
        request that runs is never preempted. `subject`: the object a segment request asks for
        (reported with its result)."""
        if isinstance(priority, bool) or not isinstance(priority, int) or not -(2**31) <= priority < 2**31:
            raise SettingsError(f"priority must be an integer (lower runs first), got {priority!r}")
        with self._preparing_lock:
            if self.max_requests is not None and self.held() >= self.max_requests:
                raise EngineBusy(f"the engine holds {self.held()} requests, its limit (EngineConfig.max_queued = "
                                 f"{self._worker.config.max_queued} queued beyond those running); retry later")
            self._preparing += 1  # until the worker holds it
        try:
            sub, st = await self._prepare(skill, image, prompt, settings, reasoning, stream, deadline_s, subject)
            sub.priority = priority
            if st is None:
                # A caller that stops waiting (its task cancelled: a timeout, a client gone) ends the
                # request in the engine too, instead of leaving it to decode for nobody. Registered
                # before the worker sees the request, so it runs before the worker's own callbacks
                # (a multi-device group forgets which device holds a request when it ends).
                rid = sub.job.request_id
                sub.future.add_done_callback(lambda f: self._worker.cancel(rid) if f.cancelled() else None)
            self._worker.submit(sub)
        finally:
            with self._preparing_lock:
                self._preparing -= 1
        return st if st is not None else await sub.future

    async def _prepare(self, skill: Skill, image: ImageInput | None, prompt: Prompt, settings: Settings,
                       reasoning: bool, stream: bool, deadline_s: float | None,
                       subject: str = "") -> tuple[Submission, Stream | None]:
        """The request's submission (its image decoded and cropped off the event loop)."""
        loop = asyncio.get_running_loop()
        arrival = time.monotonic()
        crops = tiling = digest = None
        if image is not None:
            crops, tiling, digest = await loop.run_in_executor(None, self._prepare_image, image)
        room = self.max_seq_len - len(prompt.ids) - (self.cfg.text.prefix_attn if image is not None else 1)
        if skill in ("query", "caption", "segment") and settings.max_tokens > room:
            raise SettingsError(f"max_tokens={settings.max_tokens} does not fit the context: {room} positions "
                                f"are left after the prompt (context {self.max_seq_len})")
        rid = next(_ids)
        if settings.seed is None:
            settings = dataclasses.replace(settings, seed=rid & 0xFFFFFFFF)
        job = Job(rid, skill, self.cfg, prompt, settings, reasoning=reasoning, has_image=image is not None,
                  subject=subject)
        tokens = prompt.ids if image is not None else (self.cfg.tokenizer.bos_id, *prompt.ids)
        future: asyncio.Future[Result] = loop.create_future()
        st = Stream(future, rid, self.cancel) if stream else None
        sub = Submission(job, tuple(tokens), crops, tiling, digest, future, loop, None if st is None else st.feed,
                         arrival, None if deadline_s is None else arrival + deadline_s)
        return sub, st

    def _prepare_image(self, image: ImageInput) -> tuple[np.ndarray | CropPlan, tuple[int, int], bytes]:
        """Decode, then either the device crop plan (small enough images, when the runner makes
        crops on the device) or the crops themselves, and the image's prefix-cache key."""
        pixels = load_image(image)
        runner = self._worker.runner
        s = self.cfg.vision.crop_size
        # An image already of crop size needs no resize: its crops are two copies on the host.
        on_device = runner.device_crops and pixels.shape[:2] != (s, s)
        plan = plan_crops(pixels, self.cfg.vision, canvas=runner.config.crop_canvas) if on_device else None
        crops: np.ndarray | CropPlan
        if plan is not None:
            crops, tiling = plan, image_tiling(pixels.shape[0], pixels.shape[1], self.cfg.vision)
        else:
            crops, tiling = overlap_crops(pixels, self.cfg.vision)
        crops, n = runner.crops_to_encode(crops, tiling)  # a 1x1 tiling's crop once, decided here once
        limit = runner.vision_buckets[-1]
        if n > limit:
            raise ImageError(f"this image needs {n} crops (tiling {tiling[0]}x{tiling[1]}, an "
                             f"extreme aspect ratio); the engine encodes at most {limit}")
        # The key hashes what is smaller: the (at most 1024 px) image on the device path, the crops
        # (at most 13 x 378 x 378) on the host path, where the image may be a 12 MP photo. Which path
        # an image takes depends only on its size, so an image always gets the same key.
        keyed = pixels if isinstance(crops, CropPlan) else crops
        return crops, (int(tiling[0]), int(tiling[1])), pixels_digest(keyed)


def _devices(config: EngineConfig) -> list[int]:
    """The local device indices `config` serves on (`num_devices`: 1 -> `runner.device`)."""
    import jax

    count = len(jax.local_devices())
    n = config.num_devices
    if n < 0 or n > count:
        raise ValueError(f"num_devices={n}: this process has {count} local device(s) (0 = all of them)")
    if n == 1:
        return [config.runner.device]
    return list(range(count if n == 0 else n))


def _start_group(config: EngineConfig, devices: list[int], model: Any, tokenizer: Any) -> Any:
    """One started worker per device, sharing one loaded model (each runner copies its params to
    its own device) and one tokenizer."""
    from concurrent.futures import ThreadPoolExecutor

    from kestrel_jax.serving.group import WorkerGroup
    from kestrel_jax.serving.loop import EngineWorker, load_engine_model

    model, tokenizer = load_engine_model(config, model, tokenizer)

    def start(device: int) -> Any:
        cfg = dataclasses.replace(config, num_devices=1, runner=dataclasses.replace(config.runner, device=device))
        return EngineWorker.start(cfg, model, tokenizer)

    with ThreadPoolExecutor(len(devices), thread_name_prefix="kestrel-jax-start") as pool:
        futures = [pool.submit(start, d) for d in devices]
    failed = next((f.exception() for f in futures if f.exception() is not None), None)
    if failed is not None:  # stop the devices that did start, then report the first failure
        for f in futures:
            if f.exception() is None:
                f.result().stop()
        raise failed
    return WorkerGroup([f.result() for f in futures])


def model_path_or_demo(path: str | Path | None) -> Path:
    if path is not None:
        return Path(path)
    from kestrel_jax.cli import demo_checkpoint

    return demo_checkpoint("md3")
