"""Closed-form counts of the (query, key) pairs an attention mask keeps, per request and layer kind.

The mask is the project's one semantics (docs/architecture.md):

    keep(q, k) = (k <= q and q - k < W) or (s(q) <= k <= e(q) and (not clamp or q - k < W))

A step's request computes queries at absolute positions [c - n, c - 1] against keys [0, c - 1]
(n scheduled tokens, c = context after the step). Counting pairs one by one would cost O(n * c)
Python work per step; every term below is an arithmetic series, so a request costs O(ranges).
"""

from __future__ import annotations

from collections.abc import Sequence


def _series(lo: int, hi: int) -> int:
    """lo + (lo+1) + ... + hi, 0 when empty."""
    return (lo + hi) * (hi - lo + 1) // 2 if hi >= lo else 0


def causal_pairs(num_tokens: int, context_len: int, window: int | None) -> int:
    """Pairs with k <= q and q - k < window: query p sees min(p + 1, window) keys."""
    first, last = context_len - num_tokens, context_len - 1
    if num_tokens <= 0:
        return 0
    if window is None:
        return _series(first + 1, last + 1)
    growing_last = min(last, window - 1)  # queries whose window still starts at key 0
    growing = _series(first + 1, growing_last + 1) if growing_last >= first else 0
    full_first = max(first, window)
    return growing + (window * (last - full_first + 1) if last >= full_first else 0)


def range_extra_pairs(
    num_tokens: int, context_len: int, window: int | None, ranges: Sequence[tuple[int, int]], clamp: bool
) -> int:
    """Pairs the bidirectional term adds on top of `causal_pairs`: future keys inside the query's own
    range, and (unclamped only) past keys of the range that the window cut off."""
    first, last = context_len - num_tokens, context_len - 1
    extra = 0
    for start, end in ranges:
        q_lo, q_hi = max(start, first), min(end, last)
        if q_lo > q_hi:
            continue
        key_end = min(end, last)                     # keys beyond the context do not exist yet
        extra += _series(key_end - q_hi, key_end - q_lo)  # query q sees key_end - q future keys
        if window is not None and not clamp:
            lo = max(q_lo, start + window)           # queries whose window misses part of the range
            extra += _series(lo - window - start + 1, q_hi - window - start + 1)
    return extra


def kept_pairs(
    num_tokens: int,
    context_len: int,
    window: int | None,
    ranges: Sequence[tuple[int, int]] = (),
    *,
    bidirectional: bool = False,
    clamp: bool = True,
) -> int:
    """Exact number of kept (q, k) pairs for one request on one layer kind (per head)."""
    pairs = causal_pairs(num_tokens, context_len, window)
    if bidirectional and ranges:
        pairs += range_extra_pairs(num_tokens, context_len, window, ranges, clamp)
    return pairs


def keys_touched(
    num_tokens: int,
    context_len: int,
    window: int | None,
    ranges: Sequence[tuple[int, int]] = (),
    *,
    bidirectional: bool = False,
    clamp: bool = True,
) -> int:
    """Distinct keys (cache rows) the step reads for this request: the union of its queries' windows."""
    if num_tokens <= 0:
        return 0
    first = context_len - num_tokens
    lowest = 0 if window is None else max(0, first - window + 1)
    if bidirectional and window is not None and not clamp:
        for start, end in ranges:
            if start <= context_len - 1 and end >= first:
                lowest = min(lowest, start)
    return context_len - lowest
