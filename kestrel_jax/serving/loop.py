"""The engine's worker thread: schedule (host) -> run (device) -> commit (host), forever.

One thread owns the scheduler and the runner. Submissions arrive through a queue; results and
stream chunks go back to each request's event loop with `call_soon_threadsafe`. A request that
fails (rejected by the scheduler, a bad image found late) fails alone; an unexpected error in a
step fails the requests of that step, resets nothing else, and the loop goes on.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import queue
import threading
import time
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kestrel_jax.models.device_crops import empty_plan
from kestrel_jax.models.loader import load_model
from kestrel_jax.prompts import has_segment
from kestrel_jax.serving import batch as bt
from kestrel_jax.serving.buckets import pick_bucket
from kestrel_jax.serving.encode_ahead import EncodeAhead
from kestrel_jax.serving.engine import (
    EngineConfig,
    EngineError,
    Metrics,
    Result,
    Submission,
    default_compile_threads,
    model_path_or_demo,
)
from kestrel_jax.serving.request import FinishedRequest, Request, RequestRejected
from kestrel_jax.serving.runner import Runner
from kestrel_jax.serving.scheduler import Scheduler
from kestrel_jax.serving.scheduler_config import SchedulerConfig
from kestrel_jax.serving.stepper import Pending, Stepper
from kestrel_jax.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def compile_groups(calls: list[tuple[str, tuple[Any, ...]]], threads: int,
                   decode_alone: bool) -> list[tuple[list[tuple[str, tuple[Any, ...]]], int]]:
    """The start-up compiles as (step calls, threads) groups, run in order. XLA picks each fusion's
    config by timing candidates on the GPU as it compiles (with a cold compile cache), and timings
    taken beside other compiles can pick differently. With `decode_alone`, the decode variants go
    first, one at a time, then the rest side by side."""
    decode = [c for c in calls if c[0] == "decode"] if decode_alone else []
    rest = [c for c in calls if not (decode and c[0] == "decode")]
    return [(g, n) for g, n in ((decode, 1), (rest, threads)) if g]


def load_engine_model(config: EngineConfig, model: Any = None, tokenizer: Tokenizer | None = None
                      ) -> tuple[Any, Tokenizer]:
    """(model, tokenizer): the checkpoint at `config.model_path` (or the demo model) unless a model is
    given; the checkpoint's tokenizer, else a synthetic one of the model's vocabulary."""
    if model is None:
        path = model_path_or_demo(config.model_path)
        dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[config.dtype]
        model = load_model(path, dtype=dtype, fp8_experts=config.fp8_experts, progress=False)
        tokenizer = tokenizer or Tokenizer.from_dir(path)
    if tokenizer is None:
        from kestrel_jax.tokenizer import build_synthetic_tokenizer

        tokenizer = Tokenizer(build_synthetic_tokenizer(model.cfg.text.vocab_size))
    return model, tokenizer


class EngineWorker:
    def __init__(self, config: EngineConfig, model: Any, tokenizer: Tokenizer):
        # EngineConfig.compile_threads, its default resolved for this machine
        self.compile_threads = default_compile_threads() if config.compile_threads is None else config.compile_threads
        counts = {"decode_steps": config.decode_steps, "multi_step_max_batch": config.multi_step_max_batch,
                  "compile_threads": self.compile_threads, "vision_ahead": config.vision_ahead,
                  "warmup_runs": 1 if config.warmup_runs is None else config.warmup_runs}
        bad = {k: v for k, v in counts.items() if v < 1}
        if bad:
            raise ValueError(f"these engine settings must be >= 1: {bad}")
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.mixed_buckets = config.mixed_buckets()
        # every step's packed outputs can feed the next step: room for the widest step's rows (the
        # same whether mixed steps are on or off, so both share compiled decode steps)
        out_rows = max((*config.decode_buckets, *self.mixed_buckets)) + config.max_prefill_seqs
        self.runner = Runner(model, config.runner, out_rows=out_rows)
        self.max_seq_len = self.runner.max_seq_len
        t = model.cfg.text
        self.prefix_len = t.prefix_attn
        sched_kw: dict[str, Any] = {}
        if config.max_copies is not None:
            sched_kw["max_copies"] = config.max_copies
        self.scheduler = Scheduler(SchedulerConfig(
            num_pages=self.runner.num_pages, page_size=self.runner.page_size, max_seq_len=self.max_seq_len,
            decode_buckets=config.decode_buckets, prefill_token_buckets=config.prefill_token_buckets,
            max_prefill_seqs=config.max_prefill_seqs, image_prefix_len=t.prefix_attn,
            enable_prefix_cache=config.enable_prefix_cache, mixed_decode_buckets=self.mixed_buckets,
            light_token_budget=config.light_budget(), light_below_decoding=config.prefill_light_below, **sched_kw))
        self._inbox: queue.Queue[Submission | tuple[str, int] | None] = queue.Queue()
        self._live: dict[int, Submission] = {}
        batches = self.runner.image_batches
        self._ready = self._image_ready if config.defer_unready_images and config.vision_thread else None
        self._ahead = (EncodeAhead(self._encode, self.scheduler.image_cached, config.vision_ahead,
                                   self._encode_many if batches else None, batches[-1] if batches else 1,
                                   config.vision_batch_wait_ms / 1e3)
                       if config.vision_thread else None)
        self.stepper = Stepper(self.runner, self._live, prefix_len=t.prefix_attn, bos_id=model.cfg.tokenizer.bos_id,
                               max_images=max(1, self.scheduler.config.token_budget // t.prefix_attn),
                               image_tokens=self._image_tokens)
        self._deferred: list[FinishedRequest] = []
        self._stop = threading.Event()
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kestrel-jax-engine", daemon=True)
        self.load_s: float | None = None
        self.startup_s: float | None = None
        self.compile_s: dict[str, float] = {}  # warm-up: seconds per compiled step variant
        self.admitted_before_wait = 0  # submissions taken between a launch and the wait (admit_before_wait)
        # host time of the loop's phases (seconds, cumulative): where a step's host budget goes
        self.host_s: dict[str, float] = {"inbox": 0.0, "schedule": 0.0, "dispatch": 0.0, "process": 0.0,
                                         "deliver": 0.0}

    # ------------------------------------------------------------------------------ lifecycle
    @classmethod
    def start(cls, config: EngineConfig, model: Any = None, tokenizer: Tokenizer | None = None) -> EngineWorker:
        """Load the checkpoint (or take an in-memory model, e.g. `random_model` for benchmarks),
        compile, and start the worker thread."""
        t0 = time.perf_counter()
        model, tokenizer = load_engine_model(config, model, tokenizer)
        worker = cls(config, model, tokenizer)
        worker.load_s = time.perf_counter() - t0
        if config.warmup:
            worker.warmup()
        # Everything alive now (model, compiled steps, JAX's caches) lives as long as the engine: a
        # full garbage collection walks it all (~150 ms on the CPU with even the tiny model), a
        # pause of the engine thread, so of every request. Frozen objects are never walked. (How
        # often serving triggers one is workload-dependent: once in 24 CPU test requests.)
        gc.collect()
        gc.freeze()
        worker.startup_s = time.perf_counter() - t0
        worker._thread.start()
        return worker

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=60)
        if self._ahead is not None:
            self._ahead.shutdown()
            with contextlib.suppress(Exception):  # encodings still computing: done before the engine goes
                jax.block_until_ready(self._ahead.encodings())

    @property
    def alive(self) -> bool:
        return self._failed is None and not self._stop.is_set() and self._thread.is_alive()

    def held(self) -> int:
        """Requests submitted and not yet resolved: in the inbox, waiting or running (read from
        other threads: an estimate, exact when the engine thread is between steps)."""
        return self._inbox.qsize() + len(self._live)

    def submit(self, sub: Submission) -> None:
        if self._stop.is_set() or self._failed is not None:
            raise EngineError("the engine is not running" + (f": {self._failed}" if self._failed else ""))
        self._inbox.put(sub)

    def stats(self) -> dict[str, Any]:
        return {"steps": dict(self.stepper.steps), "live": len(self._live), "num_pages": self.runner.num_pages,
                "page_size": self.runner.page_size, "kv_dtype": str(jnp.dtype(self.runner.kv_dtype)),
                "kv_scales": self.runner.config.kv_scales or "checkpoint",  # a scales file, else the checkpoint's
                "startup_s": self.startup_s, "load_s": self.load_s, "compile_s": dict(self.compile_s),
                "compile_threads": self.compile_threads,
                "host_s": {**self.host_s, "wait_outputs": self.stepper.wait_s, **self.stepper.launch_s},
                "scheduler": self.scheduler.stats,
                "images": dict(self.runner.images), "export": self.runner.export_counts,
                "queue": {"running": self.scheduler.num_running, "waiting": self.scheduler.num_waiting},
                "admitted_before_wait": self.admitted_before_wait,
                "kv_pages": {"used": self.scheduler.allocator.num_used, "free": self.scheduler.allocator.num_free},
                "prefix_cache": None if self.scheduler.prefix_cache is None else self.scheduler.prefix_cache.stats,
                "encode_ahead": None if self._ahead is None else {
                    "started": self._ahead.started, "pending": self._ahead.pending, "waiting": self._ahead.waiting,
                    "calls_by_images": dict(sorted(self._ahead.calls.items()))}}

    @property
    def warmup_runs(self) -> int:
        """EngineConfig.warmup_runs, its default resolved for this worker's device."""
        runs = self.config.warmup_runs  # >= 1 or None (checked at construction)
        if runs is None:
            return 2 if self.runner.device.platform == "gpu" else 1
        return runs

    def warmup(self) -> None:
        """Compile every decode and prefill bucket, the page copy and the vision buckets with
        inert inputs (no KV writes), running each `warmup_runs` times (a GPU builds a step's CUDA
        graph at its second run), then freeze: any later compile raises RecompileError."""
        p = self.runner.max_pages_per_seq
        runs = self.warmup_runs

        def timed(name: str, fn: Any, *args: Any) -> None:
            """Runs the variant `runs` times (EngineConfig.warmup_runs); compile_s: all of them."""
            t0 = time.perf_counter()
            for _ in range(runs):
                jax.block_until_ready(fn(*args))
            self.compile_s[name] = round(time.perf_counter() - t0, 2)

        # decode, prefill and mixed variants: (name, runner method, its arguments)
        bsz = self.config.max_prefill_seqs
        variants: list[tuple[str, str, tuple[Any, ...]]] = []
        for b in self.config.decode_buckets:
            ints, floats = bt.empty_decode(b, p)
            for k, region in self._step_variants(b):
                step_ints = ints
                if k > 1 and region:  # a multi-step launch holding a segment row (`Runner.decode_region`)
                    step_ints = ints.copy()
                    step_ints[:, bt.D_REGION] = 1
                variants.append((f"decode_b{b}_k{k}" + ("" if region else "_text"), "decode",
                                 (step_ints, floats, None, k)))
        for t in self.config.prefill_token_buckets:
            variants.append((f"prefill_t{t}", "prefill", (*bt.empty_prefill(t, bsz, p), self._no_images())))
            variants += [(f"mixed_t{t}_b{b}", "mixed", (*bt.empty_decode(b, p), None, *bt.empty_prefill(t, bsz, p),
                                                       self._no_images())) for b in self.mixed_buckets]
        if self.compile_threads > 1:  # compile them side by side first
            t0 = time.perf_counter()
            try:
                for jobs, threads in compile_groups([(kind, args) for _, kind, args in variants],
                                                    self.compile_threads, self.config.decode_alone):
                    self.runner.compile_ahead(jobs, threads)
                    if threads == 1:
                        self.compile_s["decode_alone"] = round(time.perf_counter() - t0, 2)
            except Exception as e:  # noqa: BLE001 - the runs below compile whatever is missing, in order
                log.warning("compiling the steps side by side failed (%s: %s); compiling them one by one",
                            type(e).__name__, e)
            self.compile_s["ahead"] = round(time.perf_counter() - t0, 2)
        for name, kind, args in variants:
            timed(name, getattr(self.runner, kind), *args)
        jax.block_until_ready(self.stepper.image_block([]))  # one shape whatever the image count
        for rows in self.runner.copy_buckets(self.scheduler.config.max_copies):
            for _ in range(runs):  # as timed() does
                self.runner.copy_pages(np.full((rows, 2), -1, np.int32))
        vis = self.model.cfg.vision
        crops1 = np.zeros((1, vis.crop_size, vis.crop_size, 3), np.uint8)
        for n in self.runner.vision_buckets:
            crops = np.zeros((n, vis.crop_size, vis.crop_size, 3), np.uint8)
            tiling = (1, max(1, n - 1))  # bucket 1: a 1x1 tiling
            encode = functools.partial(self.runner.encode_image, share_tile=False)  # this very bucket
            timed(f"vision_n{n}", encode, crops, tiling)
            if self.runner.device_crops:  # large images still take the host path
                plan = empty_plan(n, vis.crop_size, canvas=self.runner.config.crop_canvas)
                timed(f"crops_n{n}", encode, plan, tiling)
        # one-crop images encoded together (crops made on the device reach this step as the same
        # device arrays, so one compile serves both: tests/serving/test_runner_vision.py)
        for g in self.runner.image_batches:
            timed(f"vision_images{g}", self.runner.encode_singles, [crops1] * g)
        self.runner.images = dict.fromkeys(self.runner.images, 0)  # count served images only
        self.runner.freeze()

    def _step_variants(self, bucket: int) -> tuple[tuple[int, bool], ...]:
        """The decode steps compiled for a batch bucket: (iterations per launch, with the region
        heads). One-iteration launches always have them; a multi-step launch runs the text step
        where `RunnerConfig.text_steps` is on, and the step with the heads only for segment rows (a
        model with the segment skill: they run ahead too, `Job.can_run_ahead`)."""
        k, buckets = self.config.decode_steps, sorted(self.config.decode_buckets)
        # with at most multi_step_max_batch sequences running, the decode bucket is at most this
        largest = pick_bucket(min(self.config.multi_step_max_batch, buckets[-1]), buckets)
        if not (k > 1 and bucket <= largest):
            return ((1, True),)
        if not self.runner.config.text_steps:
            return ((1, True), (k, True))
        return ((1, True), (k, False)) + (((k, True),) if has_segment(self.model.cfg) else ())

    def _decode_steps(self, pending: Pending | None) -> int:
        """Iterations for the next decode launch: `decode_steps` when every decoding job can run
        ahead without the host (plain answer/caption tokens) and, with `decode_steps_to_finish`,
        none reaches its max_tokens before the launch would end while others go on; else 1."""
        k = self.config.decode_steps
        if k <= 1 or self.scheduler.num_running > self.config.multi_step_max_batch:
            return 1
        for rid, sub in self._live.items():
            pend = pending.outputs_of(rid) if pending is not None else 0
            if sub.job.samples == 0 and pend == 0:
                continue  # not decoding yet (queued or prefilling): not in a decode plan
            if not sub.job.can_run_ahead(pend):
                return 1
        return self.scheduler.steps_to_first_finish(k) if self.config.decode_steps_to_finish else k

    def _no_images(self) -> jax.Array:
        return self.stepper.image_block([])  # committed, as every image block while serving

    # ------------------------------------------------------------------------------ main loop
    def _run(self) -> None:
        pending: Pending | None = None  # the launched step whose outputs are not read yet
        while not self._stop.is_set():
            try:
                idle = pending is None and not self.scheduler.has_work()
                t_in = time.perf_counter()
                self._drain_inbox(block=idle)
                t0 = time.perf_counter()
                if not idle:  # admitting new requests while there is work (not waiting for any)
                    self.host_s["inbox"] += t0 - t_in
                plan = self.scheduler.schedule(self._decode_steps(pending), ready=self._ready)
                t1 = time.perf_counter()
                self.host_s["schedule"] += t1 - t0
                if plan is None:
                    if pending is not None:
                        self._process(pending)
                        pending = None
                    self._deliver_finished(None)
                    continue
                try:
                    launched = self.stepper.dispatch(plan, pending)
                except Exception as e:  # the step could not be launched: fail its requests only
                    log.exception("step failed")
                    self.scheduler.commit(plan, {sid: "error" for sid in plan.row_ids if sid is not None})
                    for sid in plan.row_ids:
                        if sid is not None:
                            self._fail(int(sid), e)  # type: ignore[call-overload]
                    if pending is not None:
                        self._process(pending)
                        pending = None
                    self._recover(e)
                    self._deliver_finished(None)
                    continue
                self.scheduler.commit(plan)
                # An image the commit cached gets its tail page copied now, in stream order after
                # the step that wrote its source, while the device is still busy with earlier
                # steps, rather than before the next step's launch, after the wait below.
                self._flush_copies()
                t2 = time.perf_counter()
                self.host_s["dispatch"] += t2 - t1
                if self.config.admit_before_wait and pending is not None:  # before the wait below
                    self.admitted_before_wait += self._drain_inbox(block=False)
                    t_in, t2 = t2, time.perf_counter()
                    self.host_s["inbox"] += t2 - t_in
                if pending is not None:  # the device is busy with `launched` meanwhile
                    self._process(pending)
                pending = launched
                if not self.config.pipeline:
                    self._process(pending)
                    pending = None
                t3 = time.perf_counter()
                self.host_s["process"] += t3 - t2
                self._deliver_finished(pending)
                self.host_s["deliver"] += time.perf_counter() - t3
            except Exception as e:  # the loop itself broke: fail everyone, refuse new work
                log.exception("engine loop failed")
                self._failed = e
                for rid in list(self._live):
                    self._fail(rid, EngineError(f"engine failed: {e}"))
                self._fail_inbox(EngineError(f"engine failed: {e}"))
                return
        if pending is not None:  # launched and never read: let it finish before the engine goes
            with contextlib.suppress(Exception):
                jax.block_until_ready(pending.out)
        for rid in list(self._live):
            self._fail(rid, EngineError("the engine was shut down"))
        self._fail_inbox(EngineError("the engine was shut down"))

    def _flush_copies(self) -> None:
        copies, n = self.scheduler.flush_copies()
        if not n:
            return
        try:
            self.stepper.copy_pages(copies, n)
        except Exception as e:  # the cached images' tails were not written: drop the cache's entries
            log.exception("page copy failed")
            self._recover(e)
            self.scheduler.clear_prefix_cache()

    def _process(self, pending: Pending) -> None:
        """Read a launched step; jobs it finished leave the scheduler now (their pages free)."""
        try:
            finished = self.stepper.process(pending)
        except Exception as e:  # the step failed on the device
            log.exception("step failed on the device")
            for rid in pending.rows:
                if self.scheduler.is_live(rid):
                    self.scheduler.cancel(rid, "error")
                self._fail(rid, e)
            self._recover(e)
            return
        for rid, reason in finished.items():
            if self.scheduler.is_live(rid):
                self.scheduler.cancel(rid, reason)

    def _recover(self, e: BaseException) -> None:
        if self.runner.recover():  # the donated KV pool was lost: every sequence with it
            for rid in list(self._live):
                if self.scheduler.is_live(rid):
                    self.scheduler.cancel(rid, "error")
                self._fail(rid, EngineError(f"KV cache lost in a failed step: {e}"))
            self.scheduler.clear_prefix_cache()

    def _fail_inbox(self, exc: BaseException) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Submission):
                self._resolve(item, exc=exc)

    def cancel(self, request_id: int) -> None:
        self._inbox.put(("cancel", request_id))

    def _drain_inbox(self, block: bool) -> int:
        """Admit the submissions and apply the cancellations waiting in the inbox; returns the
        number of submissions taken."""
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return 0
        # urgent images admitted in this drain are asked for together, after the last is queued
        with self._ahead.admitting() if self._ahead is not None else contextlib.nullcontext():
            return self._admit_drained(item)

    def _admit_drained(self, item: Submission | tuple[str, int] | None) -> int:
        taken = 0
        while True:
            if isinstance(item, tuple):
                if self.scheduler.is_live(item[1]):
                    self.scheduler.cancel(item[1])
            elif item is not None:
                self._admit(item)
                taken += 1
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return taken

    def _admit(self, sub: Submission) -> None:
        job = sub.job
        budget = min(job.step_budget(), self.max_seq_len - self._prompt_total(sub))
        req = Request(
            request_id=job.request_id, prompt_len=len(sub.tokens), max_new_tokens=max(1, budget),
            image_digest=sub.digest, prefix_len=self.prefix_len if sub.crops is not None else 0,
            prompt_tokens=None if (job.prompt.coord_slots or job.prompt.size_slots) else sub.tokens,
            arrival_time=sub.arrival, deadline=sub.deadline, priority=sub.priority)
        try:
            self.scheduler.add(req)
        except RequestRejected as e:
            self._resolve(sub, exc=e)
            return
        if sub.stream is not None:
            dec = self.tokenizer.stream_decoder()
            stream = sub.stream

            def on_text(ids: list[int]) -> None:
                text = dec.push_many(ids)
                if text:
                    with contextlib.suppress(RuntimeError):  # caller's loop closed
                        sub.loop.call_soon_threadsafe(stream.push, text)

            job.on_text = on_text
            sub.stream_decoder = dec  # type: ignore[attr-defined]
        self._live[job.request_id] = sub
        if self._ahead is not None and sub.crops is not None and sub.digest is not None:
            # EngineConfig.admit_before_wait: while every live request fits a decode batch, this
            # one's prefill comes with the next step: its image is wanted now
            urgent = self.config.admit_before_wait and len(self._live) <= max(self.config.decode_buckets)
            self._ahead.add(sub, urgent=urgent)

    def _prompt_total(self, sub: Submission) -> int:
        return len(sub.tokens) + (self.prefix_len if sub.crops is not None else 0)

    def _image_ready(self, request_id: Hashable) -> bool:
        """The scheduler's `ready` (EngineConfig.defer_unready_images): whether the request's
        image encoding is at hand for its prefill (asked for now if not)."""
        assert self._ahead is not None  # only installed with the vision thread
        sub = self._live.get(request_id)  # type: ignore[call-overload]
        return sub is None or sub.digest is None or self._ahead.ready(sub)

    def _image_tokens(self, sub: Submission, last: bool) -> jax.Array:
        """The request's image encoding for a prefill chunk (`last`: the chunk ends its image)."""
        got = self._ahead.take(sub, last) if self._ahead is not None and sub.digest is not None else None
        return self._encode(sub) if got is None else got

    def _encode(self, sub: Submission) -> jax.Array:
        assert sub.crops is not None and sub.tiling is not None
        return self.runner.encode_image(sub.crops, sub.tiling)

    def _encode_many(self, subs: list[Submission]) -> list[jax.Array]:
        assert all(s.crops is not None and s.tiling is not None for s in subs)
        return self.runner.encode_images([(s.crops, s.tiling) for s in subs])  # type: ignore[misc]

    # ------------------------------------------------------------------------------ results
    def _deliver_finished(self, pending: Pending | None) -> None:
        """Resolve finished requests, except those with an output still pending on the device."""
        todo = self._deferred + self.scheduler.take_finished()
        self._deferred = []
        for fin in todo:
            rid = int(fin.request_id)  # type: ignore[call-overload]
            if pending is not None and rid in pending.rows:
                self._deferred.append(fin)
                continue
            sub = self._live.get(rid)
            if sub is None:
                continue
            self._finish(sub, fin)

    def _finish(self, sub: Submission, fin: FinishedRequest) -> None:
        job = sub.job
        reason = job.finish_reason or fin.reason
        if reason == "deadline":
            self._resolve(sub, exc=TimeoutError("request deadline passed"))
            return
        m = fin.metrics
        first, last = sub.first_token_time, sub.last_output_time
        decode = (last - first) if (first is not None and last is not None) else 0.0
        out_tokens = job.output_tokens
        metrics = Metrics(
            ttft_ms=((first - sub.arrival) * 1e3) if first is not None else 0.0,
            prefill_time_ms=((first - (m.admitted_time or sub.arrival)) * 1e3) if first is not None else 0.0,
            decode_time_ms=decode * 1e3,
            queue_time_ms=((m.admitted_time or m.arrival_time) - m.arrival_time) * 1e3,
            input_tokens=m.prompt_tokens, output_tokens=out_tokens, cached_tokens=m.cached_tokens,
            tokens_per_s=(out_tokens - 1) / decode if decode > 0 and out_tokens > 1 else 0.0)
        self._resolve(sub, result=Result(job.output(self.tokenizer.decode), reason, metrics, job.request_id))

    def _fail(self, rid: int, exc: BaseException) -> None:
        sub = self._live.get(rid)
        if sub is not None:
            self._resolve(sub, exc=exc)

    def _resolve(self, sub: Submission, *, result: Result | None = None, exc: BaseException | None = None) -> None:
        if self._ahead is not None and sub.digest is not None:
            self._ahead.drop(sub)  # first: a request not in _live holds nothing
        self._live.pop(sub.job.request_id, None)

        def done() -> None:
            if sub.future.done():
                return
            if exc is not None:
                sub.future.set_exception(exc)
            else:
                sub.future.set_result(result)  # type: ignore[arg-type]
            if sub.stream is not None:
                dec = getattr(sub, "stream_decoder", None)
                tail = dec.finish() if dec is not None else ""
                if tail:
                    sub.stream.push(tail)
                sub.stream.push(None)

        with contextlib.suppress(RuntimeError):  # the caller's event loop closed: nobody waits any more
            sub.loop.call_soon_threadsafe(done)
