"""Static shape buckets: the device compiles one step per bucket; the host pads up to one.

Pure Python (no JAX): imported by the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence

# Decode batch sizes compiled at start-up. Steps of 16 above 32 keep padding waste under 33%
# while adding only a few compiled variants.
DEFAULT_DECODE_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 48, 64)
# Prefill token counts (flattened ragged batch). 768 covers one image prefix (730) plus a short
# prompt without jumping to 1024.
DEFAULT_PREFILL_TOKEN_BUCKETS: tuple[int, ...] = (64, 128, 256, 512, 768, 1024, 1536, 2048)


class BucketError(ValueError):
    """A size is outside the compiled buckets, or a bucket list is malformed."""


def validate_buckets(buckets: Sequence[int], name: str = "buckets") -> tuple[int, ...]:
    """Returns the buckets as a tuple after checking they are positive and strictly increasing."""
    out = tuple(int(b) for b in buckets)
    if not out:
        raise BucketError(f"{name} is empty: give at least one size")
    if out[0] < 1:
        raise BucketError(f"{name} must be positive, got {out}")
    if any(b <= a for a, b in zip(out, out[1:], strict=False)):
        raise BucketError(f"{name} must be strictly increasing, got {out}")
    return out


def pick_bucket(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n. Raises BucketError when n exceeds the largest bucket or is negative."""
    if n < 0:
        raise BucketError(f"size must be >= 0, got {n}")
    # Bucket lists are short (< 20 entries): a linear scan beats bisect's call overhead.
    for b in buckets:
        if b >= n:
            return b
    raise BucketError(
        f"size {n} exceeds the largest bucket {buckets[-1] if buckets else None}; "
        "add a larger bucket or lower the batch/token limit"
    )
