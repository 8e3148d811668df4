"""The comparisons the engine tests make across layouts (engine_helpers): a greedy divergence, a top-k
swap or a rank off by one passes only where the reference holds the entries within NEAR_TIE."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import NEAR_TIE, assert_rank_close, assert_top_ids_close, greedy_agree


def logits_with_gap(top: int, second: int, gap: float, vocab: int = 8) -> torch.Tensor:
    row = torch.zeros(vocab)
    row[top], row[second] = 1.0, 1.0 - gap
    return row


def test_greedy_agree_stops_at_a_near_tie_and_fails_elsewhere():
    rows = torch.stack([logits_with_gap(3, 5, 0.5), logits_with_gap(4, 6, NEAR_TIE / 2), logits_with_gap(1, 2, 0.5)])
    assert greedy_agree([3, 4, 1], [3, 4, 1], rows) == 3
    assert greedy_agree([3, 4, 1], [3, 6, 7], rows) == 1   # a near tie: what follows is not compared
    with pytest.raises(AssertionError, match="token 0"):
        greedy_agree([3, 4, 1], [5, 4, 1], rows)             # 0.5 apart: a real difference
    with pytest.raises(AssertionError):
        greedy_agree([3, 4, 1], [3, 4], rows)                 # a token short


def test_top_ids_and_rank_swap_only_within_a_near_tie():
    row = torch.tensor([0.0, 3.0, 2.0, 2.0 - NEAR_TIE / 2, 1.0, -1.0])
    assert_top_ids_close([1, 2, 3], row, 3)
    assert_top_ids_close([1, 3, 2], row, 3)
    assert_top_ids_close([1, 3], row, 2)                      # the k-th place: either of a tie
    for wrong in ([2, 1, 3], [1, 2, 4], [1, 2], [1, 2, 2]):
        with pytest.raises(AssertionError):
            assert_top_ids_close(wrong, row, 3)
    assert_rank_close(2, 2, row)
    assert_rank_close(3, 2, row)                               # 2 and 3 tie for second place
    assert_rank_close(2, 3, row)
    assert_rank_close(4, 4, row)
    for rank, token in ((1, 2), (4, 2), (3, 4)):
        with pytest.raises(AssertionError):
            assert_rank_close(rank, token, row)
