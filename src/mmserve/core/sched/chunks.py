"""Where a prefill chunk may end: never inside an image's or frame's range (each attends within
itself, bidirectionally, and is encoded whole); an audio segment's soft tokens are causal, so a chunk
may end inside one. `ranges` are a request's inclusive absolute [start, end] ranges, sorted and
disjoint ([K, 2] int64)."""

from __future__ import annotations

import numpy as np


def align_chunk(ranges: np.ndarray, start: int, num_tokens: int) -> int:
    """Shorten a chunk [start, start + num_tokens) so it never ends inside a range: a range the end
    would cut is left whole for a later step. Returns the new length (possibly 0)."""
    if num_tokens <= 0 or not len(ranges):
        return num_tokens
    last = start + num_tokens - 1
    i = int(np.searchsorted(ranges[:, 0], last, side="right")) - 1
    if i >= 0 and ranges[i, 0] <= last < ranges[i, 1]:
        return max(0, int(ranges[i, 0]) - start)
    return num_tokens


def smallest_chunk(ranges: np.ndarray, start: int) -> int:
    """The shortest chunk from `start` that `align_chunk` leaves whole: through the range `start`
    lies in (before its last token), else one token."""
    if not len(ranges):
        return 1
    i = int(np.searchsorted(ranges[:, 0], start, side="right")) - 1
    if i >= 0 and ranges[i, 0] <= start < ranges[i, 1]:
        return int(ranges[i, 1]) - start + 1
    return 1


def frames_in_chunk(ranges: np.ndarray, start: int, num_tokens: int) -> list[int]:
    """Indices of ranges with a token inside [start, start + num_tokens). An image's or frame's range
    lies wholly inside (align_chunk); an audio segment's may begin in an earlier chunk or end later."""
    if not len(ranges):
        return []
    lo = int(np.searchsorted(ranges[:, 1], start, side="left"))
    hi = int(np.searchsorted(ranges[:, 0], start + num_tokens, side="left"))
    return list(range(lo, hi))


def whole_lengths(ranges: np.ndarray, start: int, want: int) -> np.ndarray | None:
    """The chunk lengths from `start` up to `want` that end outside every range (sorted), or None
    when no range lies in the span (every length does)."""
    if not len(ranges) or ranges[-1, 1] < start or ranges[0, 0] >= start + want:
        return None
    ends = start + np.arange(want)   # the last position of each length 1..want
    i = np.searchsorted(ranges[:, 0], ends, side="right") - 1
    inside = (i >= 0) & (ends < ranges[np.maximum(i, 0), 1]) & (ranges[np.maximum(i, 0), 0] <= ends)
    return np.flatnonzero(~inside) + 1
