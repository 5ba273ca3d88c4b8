"""What the engine hands the scheduler (Request) and gets back when a request ends.

Pure Python (no JAX).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

# Reasons the scheduler itself ends a request with; the engine passes its own strings
# ("eos", "stop", ...) through Scheduler.commit.
FINISH_LENGTH = "length"
FINISH_CANCELLED = "cancelled"
FINISH_DEADLINE = "deadline"


class RequestRejected(ValueError):
    """add() refused a request; nothing about it is kept. Other requests are unaffected."""


class InvalidRequestError(RequestRejected):
    """Malformed request fields."""


class DuplicateRequestError(RequestRejected):
    """A waiting or running request already uses this id."""


class SequenceTooLongError(RequestRejected):
    """prefix + prompt + max_new_tokens exceeds the model context."""


class KVCapacityError(RequestRejected):
    """The request needs more KV pages than the whole pool holds: it could never run."""


@dataclass(frozen=True)
class Request:
    """One generation request as the scheduler sees it (it never looks at token meanings).

    Sequence layout: positions [0, prefix_len) are the bidirectional image prefix (BOS + 729
    image tokens, prefix_len 730) identified by `image_digest`; positions
    [prefix_len, prefix_len + prompt_len) the causal prompt; generated tokens follow.
    Text-only requests have prefix_len 0 and their prompt starts with BOS at position 0.
    """

    request_id: Hashable
    prompt_len: int  # tokens after the prefix; >= 1 (the last one yields the first logits)
    max_new_tokens: int  # >= 1, counting the token sampled at the end of prefill
    image_digest: bytes | None = None  # e.g. sha256 of the uint8 crop pixels; None = text-only
    prefix_len: int = 0  # 730 with an image, 0 without
    # Prompt token ids. Optional: given, full prompt pages become shareable through the prefix
    # cache; absent, only the image prefix is shared.
    prompt_tokens: tuple[int, ...] | None = None
    priority: int = 0  # lower runs first; FIFO by arrival within a priority
    arrival_time: float | None = None  # scheduler clock; None = the time of add()
    deadline: float | None = None  # absolute, scheduler clock; past it the request ends

    @property
    def prompt_total(self) -> int:
        """Positions filled by prefill (prefix + prompt)."""
        return self.prefix_len + self.prompt_len

    @property
    def max_positions(self) -> int:
        """KV positions the request can ever write: the last sampled token is never fed back."""
        return self.prompt_total + self.max_new_tokens - 1


@dataclass
class RequestMetrics:
    """Times are on the scheduler clock; None until the event happens."""

    arrival_time: float
    prompt_tokens: int  # prefix + prompt positions
    admitted_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    cached_tokens: int = 0  # prompt positions served from the prefix cache
    generated_tokens: int = 0

    @property
    def queue_time(self) -> float | None:
        return None if self.admitted_time is None else self.admitted_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(frozen=True)
class FinishedRequest:
    request_id: Hashable
    reason: str  # engine-given ("eos", "stop", ...) or FINISH_LENGTH / CANCELLED / DEADLINE
    metrics: RequestMetrics
