"""Turning scheduler plans into device steps, and step outputs back into job state.

`Stepper.dispatch(plan, pending)` packs one plan's inputs (batch.py) and launches the step
without waiting; `Stepper.process(pending)` reads a launched step's outputs and advances every
job in it. The engine loop launches step N+1 before it processes step N, so the host work of
one step hides under the device work of the next: a row whose latest output is still pending
takes its input from that output on the device.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kestrel_jax.serving import batch as bt
from kestrel_jax.serving.engine import Submission
from kestrel_jax.serving.plan import DecodePlan, PrefillPlan
from kestrel_jax.serving.runner import IN_COORD, IN_IMAGE, IN_SIZE, Runner
from kestrel_jax.serving.skills import StepOut


@dataclass
class Pending:
    """A launched step whose outputs the host has not read yet."""

    plan: PrefillPlan | DecodePlan
    out: jax.Array  # packed [out_rows, 6] (prefill) or [steps, out_rows, 6] (decode)
    rows: dict[int, int] = field(default_factory=dict)  # request id -> output row
    last: jax.Array | None = None  # [out_rows, 6] each row's last output (the next launch's inputs)
    row_steps: dict[int, int] = field(default_factory=dict)  # request id -> outputs (decode; default 1)

    def outputs_of(self, rid: int) -> int:
        """How many outputs this step produces for the request (0: not in it)."""
        return self.row_steps.get(rid, 1) if rid in self.rows else 0

    @property
    def feed(self) -> jax.Array:
        return self.out if self.last is None else self.last


class Stepper:
    def __init__(self, runner: Runner, live: dict[int, Submission], *, prefix_len: int, bos_id: int,
                 max_images: int, image_tokens: Callable[[Submission, bool], jax.Array]):
        self.runner = runner
        self.live = live
        self.prefix_len = prefix_len
        self.bos_id = bos_id
        self.max_images = max_images
        self.image_tokens = image_tokens
        model = runner.model
        # committed like the vision step's outputs, so the image block is committed whatever it holds
        self._zero_image = jax.device_put(jnp.zeros((prefix_len - 1, model.cfg.text.dim), model.dtype),
                                          runner.device)
        # decode_iterations: decode launches times the iterations each ran (multi-step launches run K)
        # mixed: prefill steps that also ran a decode iteration (counted in prefill, not in decode)
        self.steps = {"prefill": 0, "mixed": 0, "decode": 0, "decode_multi": 0, "decode_iterations": 0}
        self.wait_s = 0.0  # time spent blocked on step outputs (device not done yet)
        # host seconds inside the dispatch phase: the step calls by kind until they return (launching
        # the step's work on the device; launches slower than the device runs the previous step leave
        # it idle), the image encodings taken (waiting for the vision thread) and the page copies
        self.launch_s = {"launch_decode": 0.0, "launch_prefill": 0.0, "launch_mixed": 0.0, "image_wait": 0.0,
                         "copy_pages": 0.0}

    # ------------------------------------------------------------------------------ launch
    def dispatch(self, plan: PrefillPlan | DecodePlan, pending: Pending | None) -> Pending:
        if plan.num_copies:
            self.copy_pages(plan.copies, plan.num_copies)
        if isinstance(plan, DecodePlan):
            self.steps["decode"] += 1
            self.steps["decode_multi"] += plan.steps > 1
            self.steps["decode_iterations"] += plan.steps
            return self._decode(plan, pending)
        self.steps["prefill"] += 1
        self.steps["mixed"] += plan.decode is not None
        return self._prefill(plan, pending)

    def copy_pages(self, copies: np.ndarray, num_copies: int) -> None:
        with self._timed("copy_pages"):
            self.runner.copy_pages(copies, num_copies)

    def _decode(self, plan: DecodePlan, pending: Pending | None) -> Pending:
        ints, floats, rows, row_steps = self._decode_rows(plan, pending)
        with self._timed("launch_decode"):
            outs, last = self.runner.decode(ints, floats, pending.feed if pending is not None else None, plan.steps)
        return Pending(plan, outs, rows, last, row_steps)

    def _decode_rows(self, plan: DecodePlan,
                     pending: Pending | None) -> tuple[np.ndarray, np.ndarray, dict[int, int], dict[int, int]]:
        """The decode step's inputs for `plan` (batch.py layout), and request id -> row / iterations."""
        b = plan.bucket
        ints, floats = bt.empty_decode(b, plan.page_table.shape[1])
        ints[:, bt.D_POS] = plan.positions
        ints[:, bt.D_SLOT] = plan.slots
        ints[:, bt.D_KV_LEN] = plan.kv_lens
        ints[:, bt.DI:] = plan.page_table
        ints[:, bt.D_NUM_VALID] = plan.num_seqs
        rows: dict[int, int] = {}
        row_steps: dict[int, int] = {}
        for i in range(plan.num_seqs):
            rid = int(plan.seq_ids[i])  # type: ignore[call-overload]
            sub = self.live.get(rid)
            if sub is None:
                continue
            job = sub.job
            pend = pending.outputs_of(rid) if pending is not None else 0
            kind, token, value, from_prev = job.next_input(pend)
            src = pending.rows[rid] if (from_prev and pending is not None) else -1
            n = plan.steps_of(i)
            bt.decode_row(ints, floats, i, kind=kind, token=token, value=value, src=src, spec=job.row_spec(pend),
                          steps=n)
            rows[rid] = i
            row_steps[rid] = n
        bt.mark_region(ints)
        return ints, floats, rows, row_steps

    def _prefill(self, plan: PrefillPlan, pending: Pending | None) -> Pending:
        """A prefill step; with `plan.decode`, the mixed step (its decode rows' outputs come first)."""
        t, bsz = plan.bucket, plan.kv_lens.shape[0]
        tok_ints, tok_floats, seq_ints, seq_floats = bt.empty_prefill(t, bsz, plan.page_table.shape[1])
        tok_ints[:, bt.T_POS] = plan.positions
        tok_ints[:, bt.T_SLOT] = plan.slots
        tok_ints[:, bt.T_NUM_VALID] = plan.num_tokens
        seq_ints[:, bt.S_CU_END] = plan.cu_q_lens[1:]
        seq_ints[:, bt.S_KV_LEN] = plan.kv_lens
        seq_ints[:, bt.S_PREFIX] = plan.prefix_lens
        seq_ints[:, bt.S_LOGITS_ROW] = plan.logits_rows
        seq_ints[:, bt.SI:] = plan.page_table
        kind, token, img_row = tok_ints[:, bt.T_KIND], tok_ints[:, bt.T_TOKEN], tok_ints[:, bt.T_IMG_ROW]
        images: list[jax.Array] = []
        rows: dict[int, int] = {}
        first = 0 if plan.decode is None else plan.decode.bucket  # output row of sequence 0
        for b in range(plan.num_seqs):
            sid = plan.seq_ids[b]
            sub = self.live.get(int(sid)) if sid is not None else None  # type: ignore[call-overload]
            lo, hi = int(plan.cu_q_lens[b]), int(plan.cu_q_lens[b + 1])
            if sub is None or hi == lo:
                continue
            pos = plan.positions[lo:hi]
            pre = self.prefix_len if sub.crops is not None else 0
            if pre and int(pos[0]) < pre:  # this chunk holds the (uncached) image prefix
                in_img = (pos >= 1) & (pos < pre)
                kind[lo:hi][in_img] = IN_IMAGE
                img_row[lo:hi][in_img] = len(images) * (pre - 1) + pos[in_img] - 1
                token[lo:hi][pos == 0] = self.bos_id
                with self._timed("image_wait"):
                    images.append(self.image_tokens(sub, int(pos[-1]) >= pre - 1))  # last chunk of it?
            ptok = pos >= pre
            token[lo:hi][ptok] = np.asarray(sub.tokens, np.int32)[pos[ptok] - pre]
            offset = 0 if sub.crops is not None else 1  # text-only: BOS leads the token list
            for j, v in sub.job.prompt.coord_slots:
                hit = lo + np.nonzero(ptok & (pos - pre == j + offset))[0]
                kind[hit], tok_floats[hit, 0] = IN_COORD, v
            for j, (w, h) in sub.job.prompt.size_slots:
                hit = lo + np.nonzero(ptok & (pos - pre == j + offset))[0]
                kind[hit], tok_floats[hit, 0], tok_floats[hit, 1] = IN_SIZE, w, h
            if plan.logits_rows[b] >= 0:
                bt.prefill_seq_sampling(seq_ints, seq_floats, b, sub.job.row_spec(False))
                rows[int(sid)] = first + b  # type: ignore[call-overload]
        if len(images) > self.max_images:
            raise RuntimeError(f"{len(images)} images in one prefill step; at most {self.max_images} fit")
        block = self.image_block(images)
        tok_ints[:, bt.T_REGION] = bt.needs_region(seq_ints[:, bt.S_FLAGS], kind)
        if plan.decode is None:
            with self._timed("launch_prefill"):
                out = self.runner.prefill(tok_ints, tok_floats, seq_ints, seq_floats, block)
            return Pending(plan, out, rows)
        ints, floats, drows, _ = self._decode_rows(plan.decode, pending)
        tok_ints[:, bt.T_REGION] |= ints[0, bt.D_REGION]  # the mixed step's gate covers its decode rows
        with self._timed("launch_mixed"):
            out = self.runner.mixed(ints, floats, pending.feed if pending is not None else None, tok_ints,
                                    tok_floats, seq_ints, seq_floats, block)
        return Pending(plan, out, {**drows, **rows})

    @contextlib.contextmanager
    def _timed(self, key: str) -> Iterator[None]:
        """Adds the block's host time to launch_s[key]; a named range in a profiler trace."""
        t0 = time.perf_counter()
        try:
            with jax.profiler.TraceAnnotation(f"kestrel_jax.{key}"):
                yield
        finally:
            self.launch_s[key] += time.perf_counter() - t0

    def image_block(self, images: list[jax.Array]) -> jax.Array:
        """The prefill step's image input [max_images, 729, D]: these images, then zero rows.
        (A small XLA computation of its own: the engine's warm-up runs it once so that the first
        request does not compile it.)"""
        return jnp.stack([*images, *[self._zero_image] * (self.max_images - len(images))])

    # ------------------------------------------------------------------------------ results
    def process(self, pending: Pending) -> dict[int, str]:
        """Read a launched step's outputs (waits for it) and advance its jobs. Returns the jobs
        that finished: request id -> reason."""
        t0 = time.perf_counter()
        with jax.profiler.TraceAnnotation("kestrel_jax.wait_outputs"):
            raw = np.asarray(jax.device_get(pending.out))
        self.wait_s += time.perf_counter() - t0
        raw = raw[None] if raw.ndim == 2 else raw  # [steps, out_rows, 6]
        now = time.monotonic()
        finished: dict[int, str] = {}
        for rid, row in pending.rows.items():
            sub = self.live.get(rid)
            if sub is None or sub.job.finish_reason is not None:
                continue  # gone, or finished by an earlier output (this step ran ahead of it)
            if sub.first_token_time is None:
                sub.first_token_time = now
            sub.last_output_time = now
            for j in range(pending.outputs_of(rid)):
                h = raw[j, row]  # columns of runner.StepOutputs.packed
                o = StepOut(int(h[0]), float(h[1]), float(h[2]), (float(h[3]), float(h[4])), int(h[5]))
                if sub.job.advance(o):
                    finished[rid] = sub.job.finish_reason or "stop"
                    break
        return finished


def describe(p: Pending | None) -> dict[str, Any]:
    if p is None:
        return {}
    return {"kind": p.plan.kind, "rows": len(p.rows)}
