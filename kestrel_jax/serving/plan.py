"""Step plans: everything the runner needs for one device step, as numpy arrays in bucket shapes.

The runner copies these arrays to the device as they are; it does no per-row Python work.
Conventions shared by both plans:
  - Padding rows: slot -1 (the KV write drops it), kv_len 0, position 0, seq_id None.
  - page_table rows are copies of the sequence's row in the host mirror; entries past the
    sequence's pages are 0 and must be masked by kv_len.
  - A prefill plan may carry decode rows (`PrefillPlan.decode`, a one-iteration DecodePlan
    without copies): a mixed step, whose output rows are the decode rows first, then the
    prefill sequences (`row_ids`).
  - copies [C, 2] int32 (src_page, dst_page): whole-page KV copies (all layers, K and V) that
    must run before the step writes any KV. Rows past num_copies are -1. Within a plan the
    destinations are distinct and no destination is also a source, so one gather + scatter
    does them all. They exist because a page straddling the end of the image prefix is
    shared by copying (see prefix_cache.py).
Pure numpy (no JAX).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, fields
from typing import Literal

import numpy as np


def _freeze(obj: object) -> None:
    for f in fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if isinstance(value, np.ndarray):
            value.flags.writeable = False


@dataclass(frozen=True, eq=False)
class PrefillPlan:
    """A ragged batch of prompt chunks, flattened in sequence order.

    Shapes: T = token bucket, B = max_prefill_seqs, P = max pages per sequence.
    Sequence b owns rows [cu_q_lens[b], cu_q_lens[b+1]); its positions run contiguously from
    context_lens[b] to kv_lens[b] - 1. An uncached image prefix is always whole in one chunk.
    """

    step: int
    seq_ids: tuple[Hashable | None, ...]  # [B] request id per batch index, None = padding
    num_seqs: int  # real batch indices are [0, num_seqs)
    num_tokens: int  # real rows are [0, num_tokens)
    positions: np.ndarray  # [T] int32 absolute position of each row
    slots: np.ndarray  # [T] int32 flat KV slot to write, -1 = padding
    token_seq: np.ndarray  # [T] int32 batch index of each row, -1 = padding
    cu_q_lens: np.ndarray  # [B + 1] int32 row offsets; padding sequences have zero length
    kv_lens: np.ndarray  # [B] int32 tokens in KV after this step (context + new), 0 = padding
    context_lens: np.ndarray  # [B] int32 tokens already in KV before it (prefix-cache hit or earlier chunks)
    prefix_lens: np.ndarray  # [B] int32 bidirectional prefix length (730 with an image, else 0)
    page_table: np.ndarray  # [B, P] int32
    logits_rows: np.ndarray  # [B] int32 row of the last prompt token when this chunk completes the prompt, else -1
    copies: np.ndarray  # [C, 2] int32 page copies to run first (see module doc)
    num_copies: int
    # Decoding sequences advanced by one position in the same step (continuous batching): the
    # step reads the weights once for both. None: a prefill-only step.
    decode: DecodePlan | None = None
    kind: Literal["prefill"] = "prefill"

    def __post_init__(self) -> None:
        _freeze(self)
        if self.decode is not None and (self.decode.steps != 1 or self.decode.num_copies):
            raise ValueError("a prefill plan's decode rows run one iteration and copy no pages")

    @property
    def row_ids(self) -> tuple[Hashable | None, ...]:
        """Request id per output row: the decode rows (if any), then the prefill sequences."""
        return self.seq_ids if self.decode is None else self.decode.seq_ids + self.seq_ids

    @property
    def samples(self) -> np.ndarray:
        """[B] bool: sequences that get a sampled token from this step."""
        return self.logits_rows >= 0

    @property
    def bucket(self) -> int:
        return int(self.positions.shape[0])


@dataclass(frozen=True, eq=False)
class DecodePlan:
    """One new position per running sequence (or up to `steps` with multi-step decode); rows
    padded to a decode bucket B.

    Multi-step: the device runs `steps` decode iterations in one launch, each row taking its own
    previous sample as input; row i runs `row_steps[i]` of them (its remaining token budget),
    writing positions `positions[i] .. positions[i] + row_steps[i] - 1`. `positions`, `slots`
    and `kv_lens` describe the first iteration; the device derives the later slots from the
    page-table row.
    """

    step: int
    seq_ids: tuple[Hashable | None, ...]  # [B] request id per row, None = padding
    num_seqs: int  # real rows are [0, num_seqs)
    positions: np.ndarray  # [B] int32 position of the input token
    slots: np.ndarray  # [B] int32 flat KV slot for it, -1 = padding
    kv_lens: np.ndarray  # [B] int32 positions + 1, 0 = padding
    page_table: np.ndarray  # [B, P] int32
    copies: np.ndarray  # [C, 2] int32 page copies to run first (see module doc)
    num_copies: int
    steps: int = 1  # decode iterations in this launch (the compiled variant)
    row_steps: np.ndarray | None = None  # [B] int32 iterations per row (0 = padding); None: all 1
    kind: Literal["decode"] = "decode"

    def __post_init__(self) -> None:
        _freeze(self)

    @property
    def bucket(self) -> int:
        return int(self.positions.shape[0])

    @property
    def row_ids(self) -> tuple[Hashable | None, ...]:
        return self.seq_ids

    def steps_of(self, row: int) -> int:
        if self.row_steps is None:
            return 1 if row < self.num_seqs else 0
        return int(self.row_steps[row])


StepPlan = PrefillPlan | DecodePlan
