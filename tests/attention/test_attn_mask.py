"""mask.py against the formula applied pair by pair, and the two behaviours a video prompt relies on."""

from __future__ import annotations

import pytest
import torch
from attn_batches import SLIDING_SPEC, SPECS, Req, frames, make_batch, standard_batches

from mmserve.attention.mask import batch_dense_mask, keep_for_spec, keep_into


def naive_row(spec, q: int, r_start: int, r_end: int, seq_len: int, block_row: list[int], block_size: int):
    """The formula literally, one pair at a time, plus the key-validity rules of the contract."""
    row = []
    for k in range(seq_len):
        causal = k <= q and (spec.window is None or q - k < spec.window)
        in_range = spec.bidirectional and r_start <= k <= r_end
        if in_range and spec.clamp_bidirectional and spec.window is not None:
            in_range = q - k < spec.window
        row.append((causal or in_range) and block_row[k // block_size] != 0)
    return row


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.layer_type}-bidi{s.bidirectional}-clamp{s.clamp_bidirectional}")
@pytest.mark.parametrize("name", list(standard_batches()))
def test_batch_mask_matches_pairwise_formula(spec, name):
    batch = make_batch(standard_batches()[name], spec, free_outside_window=True)
    md = batch.metadata
    mask = batch_dense_mask(md, spec)
    ranges = md.query_ranges if md.query_ranges is not None else torch.full((md.num_actual_tokens, 2), -1)
    qsl = md.query_start_loc.tolist()
    for r, req in enumerate(batch.reqs):
        for i in range(qsl[r], qsl[r + 1]):
            expected = naive_row(spec, int(md.positions[i]), int(ranges[i, 0]), int(ranges[i, 1]), req.seq_len,
                                 md.block_table[r].tolist(), md.block_size)
            assert mask[i, : req.seq_len].tolist() == expected
            assert not mask[i, req.seq_len:].any()


def test_future_key_inside_frame_is_kept_and_outside_is_not():
    spec = SLIDING_SPEC
    (s, e), = frames(10, 1, 6, 0)
    q = s + 1
    assert keep_for_spec(q, e, s, e, spec)            # future key, same frame: attended
    assert not keep_for_spec(q, e + 1, s, e, spec)    # first key after the frame: not attended
    assert not keep_for_spec(q, e + 5, -1, -1, spec)  # a text query never sees the future
    assert keep_for_spec(q, s, s, e, spec)


def test_clamp_drops_old_frame_keys_only_when_set():
    spec = SLIDING_SPEC  # window 8, clamped
    s, e = 0, 19
    assert not keep_for_spec(15, 2, s, e, spec)
    unclamped = type(spec)(**{**spec.__dict__, "clamp_bidirectional": False})
    assert keep_for_spec(15, 2, s, e, unclamped)
    assert keep_for_spec(15, 19, s, e, spec)  # the window bounds the past only


def test_batch_mask_rows_follow_each_requests_own_ranges():
    reqs = [Req(0, 12, [(2, 7)]), Req(0, 12)]
    batch = make_batch(reqs, SLIDING_SPEC)
    mask = batch_dense_mask(batch.metadata, SLIDING_SPEC)
    assert mask[2, 7] and not mask[12 + 2, 7]  # same positions, only the first request has the frame


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.layer_type}-bidi{s.bidirectional}-clamp{s.clamp_bidirectional}")
def test_keep_into_is_keep_without_allocating(spec):
    """The builders' in-place form equals keep() on random positions, ranges and keys."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    q = torch.randint(0, 60, (5, 7, 1), generator=gen)
    k = torch.randint(0, 60, (5, 1, 40), generator=gen)
    r_start = torch.randint(-1, 50, (5, 7, 1), generator=gen)
    r_end = torch.where(r_start >= 0, r_start + torch.randint(0, 20, (5, 7, 1), generator=gen), -1)
    shape = (5, 7, 40)
    out = torch.empty(shape, dtype=torch.bool)
    scratch = [torch.empty(shape, dtype=torch.int64)] + [torch.empty(shape, dtype=torch.bool) for _ in range(3)]
    for ranges in ((r_start, r_end), (None, None)):
        want = keep_for_spec(q, k, *(ranges if ranges[0] is not None else (torch.full_like(q, -1),) * 2), spec)
        got = keep_into(out, q, k, *ranges, spec, scratch)
        assert got is out and torch.equal(got, want.expand(shape))
