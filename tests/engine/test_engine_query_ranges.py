"""The mm_prefix query-range table against the naive "q and k share a range" scan."""

from __future__ import annotations

import random

import numpy as np
import pytest
from sched_helpers import random_ranges

from mmserve.worker.step_inputs import fill_query_ranges

POISON = 7777


def naive_same_range(q: int, k: int, ranges) -> bool:
    return any(s < e and s <= q <= e and s <= k <= e for s, e in ranges)


def random_batch(rng: random.Random):
    """Requests with context offsets, chunks cutting through ranges, and decode rows."""
    qsl, ctx, ranges = [0], [], []
    for _ in range(rng.randint(1, 7)):
        total = rng.randint(1, 80)
        rg = random_ranges(rng, total, max_len=15, density=0.3)
        kind = rng.random()
        if kind < 0.25:          # decode: one token past the prompt
            c, n = total, 1
        else:
            c = rng.randint(0, total - 1)
            n = rng.randint(1, total - c)
        qsl.append(qsl[-1] + n)
        ctx.append(c)
        ranges.append(np.asarray(rg, dtype=np.int64).reshape(-1, 2))
    return np.asarray(qsl, np.int32), np.asarray(ctx, np.int64), ranges


@pytest.mark.parametrize("seed", range(40))
def test_table_matches_naive_scan(seed):
    rng = random.Random(seed)
    qsl, ctx, ranges = random_batch(rng)
    out = np.full((256, 2), POISON, dtype=np.int32)
    rows = fill_query_ranges(out, qsl, ctx, ranges)
    T = int(qsl[-1])
    any_in_range = False
    for r in range(len(ctx)):
        for i in range(qsl[r], qsl[r + 1]):
            q = int(ctx[r]) + i - int(qsl[r])
            in_some = any(s < e and s <= q <= e for s, e in ranges[r].tolist())
            any_in_range |= in_some
            if rows == 0:
                continue
            s, e = out[i]
            assert (s, e) == (-1, -1) or s <= q <= e
            for k in range(0, int(ctx[r]) + int(qsl[r + 1] - qsl[r]) + 20):
                assert (s <= k <= e) == naive_same_range(q, k, ranges[r].tolist()), (r, q, k)
    if any_in_range:
        assert rows == T
        assert (out[T:] == POISON).all()
    else:
        assert rows == 0 and (out == POISON).all(), "no range covers a query: the buffer must be untouched"


def test_clipping_and_none_cases():
    out = np.full((64, 2), POISON, dtype=np.int32)
    one = lambda *rg: [np.asarray(rg, dtype=np.int64).reshape(-1, 2)]  # noqa: E731
    # range wholly ahead of the chunk [0, 5): none
    assert fill_query_ranges(out, np.array([0, 5]), np.array([0]), one((10, 20))) == 0
    # decode token past the range, and single-token ranges: none
    assert fill_query_ranges(out, np.array([0, 1]), np.array([30]), one((10, 20))) == 0
    assert fill_query_ranges(out, np.array([0, 8]), np.array([0]), one((2, 2), (5, 5))) == 0
    assert fill_query_ranges(out, np.array([0, 8]), np.array([0]), one()) == 0
    assert (out == POISON).all()
    # chunk [8, 16) cuts [5, 10] and [14, 30]: rows keep the full absolute range, others are (-1, -1)
    assert fill_query_ranges(out, np.array([0, 8]), np.array([8]), one((5, 10), (14, 30))) == 8
    assert out[:8].tolist() == [[5, 10]] * 3 + [[-1, -1]] * 3 + [[14, 30]] * 2


def test_reuse_leaves_no_stale_rows():
    out = np.full((64, 2), POISON, dtype=np.int32)
    big = [np.array([[0, 39]], dtype=np.int64)]
    assert fill_query_ranges(out, np.array([0, 40]), np.array([0]), big) == 40
    small = [np.array([[2, 3]], dtype=np.int64), np.array([[0, 5]], dtype=np.int64)]
    assert fill_query_ranges(out, np.array([0, 6, 7]), np.array([0, 9]), small) == 7
    assert out[:7].tolist() == [[-1, -1]] * 2 + [[2, 3]] * 2 + [[-1, -1]] * 3
