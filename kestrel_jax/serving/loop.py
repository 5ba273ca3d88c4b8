"""The engine's worker thread: schedule (host) -> run (device) -> commit (host), forever.

One thread owns the scheduler and the runner. Submissions arrive through a queue; results and
stream chunks go back to each request's event loop with `call_soon_threadsafe`. A request that
fails (rejected by the scheduler, a bad image found late) fails alone; an unexpected error in a
step fails the requests of that step, resets nothing else, and the loop goes on.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kestrel_jax.models.loader import load_model
from kestrel_jax.pallas.sampling import SamplingParams
from kestrel_jax.serving.engine import EngineConfig, EngineError, Metrics, Result, Submission, model_path_or_demo
from kestrel_jax.serving.plan import DecodePlan, PrefillPlan
from kestrel_jax.serving.request import Request, RequestRejected
from kestrel_jax.serving.runner import IN_IMAGE, RowFlags, RowInputs, Runner, StepOutputs, sampling_arrays
from kestrel_jax.serving.scheduler import Scheduler
from kestrel_jax.serving.scheduler_config import SchedulerConfig
from kestrel_jax.serving.skills import StepOut
from kestrel_jax.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class EngineWorker:
    def __init__(self, config: EngineConfig, model: Any, tokenizer: Tokenizer):
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.runner = Runner(model, config.runner)
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
            enable_prefix_cache=config.enable_prefix_cache, **sched_kw))
        self.max_images = max(1, self.scheduler.config.token_budget // t.prefix_attn)
        self._zero_image = jnp.zeros((t.prefix_attn - 1, t.dim), model.dtype)
        self._inbox: queue.Queue[Submission | None] = queue.Queue()
        self._live: dict[int, Submission] = {}
        self._images: dict[int, jax.Array] = {}
        self._stop = threading.Event()
        self._failed: BaseException | None = None
        self._steps = {"prefill": 0, "decode": 0}
        self._thread = threading.Thread(target=self._run, name="kestrel-jax-engine", daemon=True)
        self.load_s: float | None = None
        self.startup_s: float | None = None

    # ------------------------------------------------------------------------------ lifecycle
    @classmethod
    def start(cls, config: EngineConfig, model: Any = None, tokenizer: Tokenizer | None = None) -> EngineWorker:
        """Load the checkpoint (or take an in-memory model, e.g. `random_model` for benchmarks),
        compile, and start the worker thread."""
        t0 = time.perf_counter()
        if model is None:
            path = model_path_or_demo(config.model_path)
            dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[config.dtype]
            model = load_model(path, dtype=dtype, fp8_experts=config.fp8_experts, progress=False)
            tokenizer = tokenizer or Tokenizer.from_dir(path)
        if tokenizer is None:
            from kestrel_jax.tokenizer import build_synthetic_tokenizer

            tokenizer = Tokenizer(build_synthetic_tokenizer(model.cfg.text.vocab_size))
        worker = cls(config, model, tokenizer)
        worker.load_s = time.perf_counter() - t0
        if config.warmup:
            worker.warmup()
        worker.startup_s = time.perf_counter() - t0
        worker._thread.start()
        return worker

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=60)

    def submit(self, sub: Submission) -> None:
        if self._stop.is_set() or self._failed is not None:
            raise EngineError("the engine is not running" + (f": {self._failed}" if self._failed else ""))
        self._inbox.put(sub)

    def stats(self) -> dict[str, Any]:
        return {"steps": dict(self._steps), "live": len(self._live), "num_pages": self.runner.num_pages,
                "page_size": self.runner.page_size, "kv_dtype": str(jnp.dtype(self.runner.kv_dtype)),
                "startup_s": self.startup_s, "load_s": self.load_s,
                "scheduler": self.scheduler.stats}

    def warmup(self) -> None:
        """Compile every decode and prefill bucket (and the common vision shapes) with inert
        inputs (no KV writes), then freeze: any later compile raises RecompileError."""
        p = self.runner.max_pages_per_seq
        c = self.scheduler.config.max_copies
        for b in self.config.decode_buckets:
            self._decode_arrays_run(b, p, c)
        for t in self.config.prefill_token_buckets:
            self._prefill_inert(t, p, c)
        vis = self.model.cfg.vision
        for n in self.runner.vision_buckets:
            crops = np.zeros((n, vis.crop_size, vis.crop_size, 3), np.uint8)
            jax.block_until_ready(self.runner.encode_image(crops, (1, n - 1)))
        self.runner.freeze()

    def _decode_arrays_run(self, b: int, p: int, c: int) -> None:
        rows = RowInputs(np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros((b, 2), np.float32),
                         np.full(b, -1, np.int32))
        sp = SamplingParams(**sampling_arrays(b))
        flags = RowFlags(np.zeros(b, bool), np.zeros(b, bool))
        out = self.runner.decode(rows, np.zeros(b, np.int32), np.full(b, -1, np.int32), np.zeros(b, np.int32),
                                 np.zeros((b, p), np.int32), np.full((c, 2), -1, np.int32), sp, flags)
        jax.block_until_ready(out)

    def _prefill_inert(self, t: int, p: int, c: int) -> None:
        bsz = self.config.max_prefill_seqs
        rows = RowInputs(np.zeros(t, np.int32), np.zeros(t, np.int32), np.zeros((t, 2), np.float32),
                         np.full(t, -1, np.int32))
        sp = SamplingParams(**sampling_arrays(bsz))
        flags = RowFlags(np.zeros(bsz, bool), np.zeros(bsz, bool))
        out = self.runner.prefill(rows, self._image_block([]), np.zeros(t, np.int32), np.full(t, -1, np.int32),
                                  np.zeros(bsz + 1, np.int32), np.zeros(bsz, np.int32), np.zeros((bsz, p), np.int32),
                                  np.zeros(bsz, np.int32), np.full(bsz, -1, np.int32), np.full((c, 2), -1, np.int32),
                                  sp, flags)
        jax.block_until_ready(out)

    # ------------------------------------------------------------------------------ main loop
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain_inbox(block=not self.scheduler.has_work())
                plan = self.scheduler.schedule()
                if plan is None:
                    self._deliver_finished()
                    continue
                try:
                    finished = self._execute(plan)
                except Exception as e:  # a step failed: fail its requests, keep serving the rest
                    log.exception("step failed")
                    finished = {sid: "error" for sid in plan.seq_ids if sid is not None}
                    for sid in finished:
                        self._fail(int(sid), e)
                    if self.runner.recover():  # the donated KV pool was lost: every sequence with it
                        for rid in list(self._live):
                            finished[rid] = "error"
                            self._fail(rid, EngineError(f"KV cache lost in a failed step: {e}"))
                        self.scheduler.clear_prefix_cache()
                self.scheduler.commit(plan, finished)
                self._deliver_finished()
            except Exception as e:  # the loop itself broke: fail everyone, refuse new work
                log.exception("engine loop failed")
                self._failed = e
                for rid in list(self._live):
                    self._fail(rid, EngineError(f"engine failed: {e}"))
                return
        for rid in list(self._live):
            self._fail(rid, EngineError("the engine was shut down"))

    def cancel(self, request_id: int) -> None:
        self._inbox.put(("cancel", request_id))  # type: ignore[arg-type]

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(item, tuple):
                self.scheduler.cancel(item[1])
            elif item is not None:
                self._admit(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _admit(self, sub: Submission) -> None:
        job = sub.job
        budget = min(job.step_budget(), self.max_seq_len - self._prompt_total(sub))
        req = Request(
            request_id=job.request_id, prompt_len=len(sub.tokens), max_new_tokens=max(1, budget),
            image_digest=sub.digest, prefix_len=self.prefix_len if sub.crops is not None else 0,
            prompt_tokens=None if (job.prompt.coord_slots or job.prompt.size_slots) else sub.tokens,
            arrival_time=sub.arrival, deadline=sub.deadline)
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
                        sub.loop.call_soon_threadsafe(stream._push, text)

            job.on_text = on_text
            sub.stream_decoder = dec  # type: ignore[attr-defined]
        self._live[job.request_id] = sub

    def _prompt_total(self, sub: Submission) -> int:
        return len(sub.tokens) + (self.prefix_len if sub.crops is not None else 0)

    # ------------------------------------------------------------------------------ steps
    def _execute(self, plan: PrefillPlan | DecodePlan) -> dict[Any, str]:
        if isinstance(plan, PrefillPlan):
            out = self._run_prefill(plan)
            self._steps["prefill"] += 1
            rows = [(b, plan.seq_ids[b]) for b in range(plan.num_seqs) if plan.logits_rows[b] >= 0]
        else:
            out = self._run_decode(plan)
            self._steps["decode"] += 1
            rows = [(b, plan.seq_ids[b]) for b in range(plan.num_seqs)]
        host = jax.device_get(out)
        finished: dict[Any, str] = {}
        for b, sid in rows:
            sub = self._live.get(int(sid))  # type: ignore[call-overload]
            if sub is None:
                continue
            o = StepOut(int(host.tokens[b]), float(host.logprobs[b]), float(host.coord[b]),
                        (float(host.size[b, 0]), float(host.size[b, 1])), int(host.region_next[b]))
            if sub.job.advance(o):
                finished[sid] = sub.job.finish_reason or "stop"
        return finished

    def _sampling(self, subs: list[Submission | None], b: int) -> tuple[SamplingParams, RowFlags]:
        arr = sampling_arrays(b)
        region = np.zeros(b, bool)
        reasoning = np.zeros(b, bool)
        for i, sub in enumerate(subs):
            if sub is None:
                continue
            job = sub.job
            row = job.sampling_row()
            arr["temperature"][i] = row["temperature"]
            arr["top_p"][i] = row["top_p"]
            arr["top_k"][i] = row["top_k"]
            arr["seed"][i] = job.settings.seed or 0
            arr["step"][i] = job.samples
            sup = row["suppressed"][: arr["suppressed_ids"].shape[1]]
            arr["suppressed_ids"][i, : len(sup)] = sup
            region[i] = job.wants_region
            reasoning[i] = job.phase == "reasoning"
        return SamplingParams(**arr), RowFlags(region, reasoning)

    def _run_decode(self, plan: DecodePlan) -> StepOutputs:
        b = plan.bucket
        kind = np.zeros(b, np.int32)
        token = np.zeros(b, np.int32)
        value = np.zeros((b, 2), np.float32)
        subs: list[Submission | None] = [None] * b
        for i in range(plan.num_seqs):
            sub = self._live.get(int(plan.seq_ids[i]))  # type: ignore[call-overload]
            if sub is None:
                continue
            subs[i] = sub
            kind[i], token[i], value[i] = sub.job.next_kind, sub.job.next_token, sub.job.next_value
        sp, flags = self._sampling(subs, b)
        rows = RowInputs(kind, token, value, np.full(b, -1, np.int32))
        return self.runner.decode(rows, plan.positions, plan.slots, plan.kv_lens, plan.page_table, plan.copies,
                                  sp, flags)

    def _run_prefill(self, plan: PrefillPlan) -> StepOutputs:
        t = plan.bucket
        bsz = plan.kv_lens.shape[0]
        kind = np.zeros(t, np.int32)
        token = np.zeros(t, np.int32)
        value = np.zeros((t, 2), np.float32)
        image_row = np.full(t, -1, np.int32)
        images: list[Any] = []
        subs: list[Submission | None] = [None] * bsz
        for b in range(plan.num_seqs):
            sub = self._live.get(int(plan.seq_ids[b]))  # type: ignore[call-overload]
            lo, hi = int(plan.cu_q_lens[b]), int(plan.cu_q_lens[b + 1])
            if sub is None or hi == lo:
                continue
            subs[b] = sub
            pos = plan.positions[lo:hi]
            pre = self.prefix_len if sub.crops is not None else 0
            if pre and int(pos[0]) < pre:  # this chunk holds the (uncached) image prefix
                img_idx = len(images)
                images.append(self._image_tokens(sub))
                in_img = (pos >= 1) & (pos < pre)
                kind[lo:hi][in_img] = IN_IMAGE
                image_row[lo:hi][in_img] = img_idx * (pre - 1) + pos[in_img] - 1
                token[lo:hi][pos == 0] = self.model.cfg.tokenizer.bos_id
            ptok = pos >= pre
            idx = pos[ptok] - pre
            token[lo:hi][ptok] = np.asarray(sub.tokens, np.int32)[idx]
            offset = 0 if sub.crops is not None else 1  # text-only: BOS leads the token list
            for j, v in sub.job.prompt.coord_slots:
                hit = np.nonzero(ptok & (pos - pre == j + offset))[0]
                kind[lo + hit], value[lo + hit, 0] = 1, v
            for j, (w, h) in sub.job.prompt.size_slots:
                hit = np.nonzero(ptok & (pos - pre == j + offset))[0]
                kind[lo + hit], value[lo + hit] = 2, (w, h)
        sp, flags = self._sampling([s if (s is not None and plan.logits_rows[i] >= 0) else None
                                    for i, s in enumerate(subs)], bsz)
        rows = RowInputs(kind, token, value, image_row)
        return self.runner.prefill(rows, self._image_block(images), plan.positions, plan.slots, plan.cu_q_lens,
                                   plan.kv_lens, plan.page_table, plan.prefix_lens, plan.logits_rows, plan.copies,
                                   sp, flags)

    def _image_tokens(self, sub: Submission) -> jax.Array:
        rid = sub.job.request_id
        if rid not in self._images:
            assert sub.crops is not None and sub.tiling is not None
            self._images[rid] = self.runner.encode_image(sub.crops, sub.tiling)
        return self._images.pop(rid)

    def _image_block(self, images: list[Any]) -> jax.Array:
        if len(images) > self.max_images:
            raise RuntimeError(f"{len(images)} images in one prefill step; at most {self.max_images} fit")
        pad = [self._zero_image] * (self.max_images - len(images))
        return jnp.stack([*images, *pad])

    # ------------------------------------------------------------------------------ results
    def _deliver_finished(self) -> None:
        for fin in self.scheduler.take_finished():
            sub = self._live.get(int(fin.request_id))  # type: ignore[call-overload]
            if sub is None:
                continue
            job = sub.job
            reason = job.finish_reason or fin.reason
            m = fin.metrics
            ttft = (m.first_token_time - m.arrival_time) if m.first_token_time else 0.0
            prefill = (m.first_token_time - m.admitted_time) if (m.first_token_time and m.admitted_time) else 0.0
            decode = ((m.finished_time or time.monotonic()) - m.first_token_time) if m.first_token_time else 0.0
            out_tokens = job.output_tokens
            metrics = Metrics(ttft_ms=ttft * 1e3, prefill_time_ms=prefill * 1e3, decode_time_ms=decode * 1e3,
                              queue_time_ms=((m.admitted_time or m.arrival_time) - m.arrival_time) * 1e3,
                              input_tokens=m.prompt_tokens, output_tokens=out_tokens, cached_tokens=m.cached_tokens,
                              tokens_per_s=(out_tokens - 1) / decode if decode > 0 and out_tokens > 1 else 0.0)
            if reason in ("cancelled", "deadline", "error"):
                exc = TimeoutError("request deadline passed") if reason == "deadline" else None
                if exc is not None:
                    self._resolve(sub, exc=exc)
                    continue
            self._resolve(sub, result=Result(job.output(self.tokenizer.decode), reason, metrics, job.request_id))

    def _fail(self, rid: int, exc: BaseException) -> None:
        sub = self._live.get(rid)
        if sub is not None:
            self._resolve(sub, exc=exc)

    def _resolve(self, sub: Submission, *, result: Result | None = None, exc: BaseException | None = None) -> None:
        self._live.pop(sub.job.request_id, None)
        self._images.pop(sub.job.request_id, None)

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
                    sub.stream._push(tail)
                sub.stream._push(None)

        with contextlib.suppress(RuntimeError):  # the caller's event loop closed: nobody waits any more
            sub.loop.call_soon_threadsafe(done)
