"""Scheduler configuration (frozen) and counters. Pure Python (no JAX)."""

from __future__ import annotations

from dataclasses import dataclass

from kestrel_jax.serving.buckets import (
    DEFAULT_DECODE_BUCKETS,
    DEFAULT_PREFILL_TOKEN_BUCKETS,
    validate_buckets,
)
from kestrel_jax.serving.pages import pages_for

IMAGE_PREFIX_LEN = 730  # BOS + 27 * 27 image tokens (MOONDREAM.md §4)


@dataclass(frozen=True)
class SchedulerConfig:
    num_pages: int  # KV pool size in pages
    page_size: int = 64  # positions per page, a power of two
    max_seq_len: int = 4096  # model context: prefix + prompt + max_new_tokens must fit
    decode_buckets: tuple[int, ...] = DEFAULT_DECODE_BUCKETS
    max_running: int | None = None  # sequences holding KV at once; default: largest decode bucket
    prefill_token_buckets: tuple[int, ...] = DEFAULT_PREFILL_TOKEN_BUCKETS
    prefill_token_budget: int | None = None  # new tokens per prefill step; default: largest bucket
    max_prefill_seqs: int = 8  # batch dimension B of every prefill plan
    image_prefix_len: int = IMAGE_PREFIX_LEN
    enable_prefix_cache: bool = True
    # Mixed steps (continuous batching): a prefill step also advances every decoding sequence by
    # one position when they fit one of these row buckets. () = prefill steps carry no decode rows.
    mixed_decode_buckets: tuple[int, ...] = ()
    # Under light load a prefill step takes at most `light_token_budget` new tokens: while fewer
    # than `light_below_decoding` sequences decode (None: the full budget always). Many prompts per
    # step pay where many clients wait behind them, and cost first-token latency where few do.
    light_token_budget: int | None = None
    light_below_decoding: int = 0

    def __post_init__(self) -> None:
        if self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        object.__setattr__(self, "decode_buckets", validate_buckets(self.decode_buckets, "decode_buckets"))
        object.__setattr__(
            self,
            "prefill_token_buckets",
            validate_buckets(self.prefill_token_buckets, "prefill_token_buckets"),
        )
        if self.mixed_decode_buckets:
            object.__setattr__(self, "mixed_decode_buckets",
                               validate_buckets(self.mixed_decode_buckets, "mixed_decode_buckets"))
        if self.max_running is None:
            object.__setattr__(self, "max_running", self.decode_buckets[-1])
        if self.prefill_token_budget is None:
            object.__setattr__(self, "prefill_token_budget", self.prefill_token_buckets[-1])
        if not 1 <= self.running_limit <= self.decode_buckets[-1]:
            raise ValueError(
                f"max_running={self.max_running} must be in [1, largest decode bucket "
                f"{self.decode_buckets[-1]}] so every decode batch has a compiled shape"
            )
        if not 1 <= self.token_budget <= self.prefill_token_buckets[-1]:
            raise ValueError(
                f"prefill_token_budget={self.prefill_token_budget} must be in [1, largest prefill "
                f"bucket {self.prefill_token_buckets[-1]}]"
            )
        if self.image_prefix_len > self.token_budget:
            raise ValueError(
                f"prefill_token_budget={self.prefill_token_budget} is below image_prefix_len="
                f"{self.image_prefix_len}: the bidirectional prefix must be prefilled in one chunk"
            )
        if self.light_token_budget is not None and not (
                self.image_prefix_len <= self.light_token_budget <= self.token_budget):
            raise ValueError(
                f"light_token_budget={self.light_token_budget} must be in [image_prefix_len="
                f"{self.image_prefix_len}, prefill_token_budget={self.token_budget}]")
        if self.light_below_decoding < 0:
            raise ValueError(f"light_below_decoding must be >= 0, got {self.light_below_decoding}")
        if self.max_prefill_seqs < 1:
            raise ValueError(f"max_prefill_seqs must be >= 1, got {self.max_prefill_seqs}")
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")

    @property
    def running_limit(self) -> int:
        assert self.max_running is not None
        return self.max_running

    @property
    def token_budget(self) -> int:
        assert self.prefill_token_budget is not None
        return self.prefill_token_budget

    @property
    def max_pages_per_seq(self) -> int:
        return pages_for(self.max_seq_len, self.page_size)

    @property
    def max_copies(self) -> int:
        # Tail copies made by the previous prefill step's commit + hit copies of this step's
        # admissions (at most one each).
        return self.max_prefill_seqs + self.running_limit


@dataclass
class SchedulerStats:
    prefill_steps: int = 0
    decode_steps: int = 0  # decode launches
    mixed_steps: int = 0  # prefill steps that also carried decode rows (counted in prefill_steps)
    decode_iterations: int = 0  # decode positions advanced per row slot (launches x iterations)
    prefill_tokens: int = 0  # real rows computed by prefill steps
    prefill_padding: int = 0  # padding rows in prefill buckets
    decode_rows: int = 0  # real row-iterations (mixed steps' decode rows included)
    decode_padding: int = 0  # padding row-iterations (likewise)
    cached_tokens: int = 0  # prompt positions served from the prefix cache
    admitted: int = 0
    finished: int = 0
    cancelled: int = 0
    expired: int = 0
    rejected: int = 0
    # schedule() calls that held back an image prefill whose encoding was not ready (`ready`) and
    # launched a one-iteration decode step instead
    deferred_prefills: int = 0
