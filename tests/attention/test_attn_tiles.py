"""Tile lists must cover every kept pair (a missed tile silently drops keys) and stay near the exact work."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from attn_batches import SLIDING_SPEC, SPECS, Req, frames, make_batch, standard_batches

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))   # tile_analysis (analysis code, not serving)
from tile_analysis import kept_pairs, varlen_tiles

from mmserve.attention.mask import batch_dense_mask


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.layer_type}-bidi{s.bidirectional}-clamp{s.clamp_bidirectional}")
@pytest.mark.parametrize("tile_q,tile_k", [(16, 16), (8, 32)])
def test_tiles_cover_every_kept_pair(spec, tile_q, tile_k):
    for reqs in standard_batches().values():
        check_cover(make_batch(reqs, spec, free_outside_window=True), spec, tile_q, tile_k)


def check_cover(batch, spec, tile_q, tile_k):
    md = batch.metadata
    tiles = varlen_tiles(md, spec, tile_q, tile_k)
    mask = batch_dense_mask(md, spec)
    qsl, seq = md.query_start_loc.tolist(), md.seq_lens.tolist()
    cu_m, cu_idx = tiles.cu_total_m_blocks.tolist(), tiles.cu_block_idx_offsets.tolist()
    for r in range(md.num_reqs):
        n_r = -(-seq[r] // tile_k)
        for m in range(cu_m[r + 1] - cu_m[r]):
            t = cu_m[r] + m
            start = cu_idx[r] + m * n_r
            listed = set(tiles.block_idx[0, start: start + int(tiles.block_cnt[0, t])].tolist())
            rows = mask[qsl[r] + m * tile_q: min(qsl[r + 1], qsl[r] + (m + 1) * tile_q), : seq[r]]
            needed = {int(k) // tile_k for k in torch.nonzero(rows.any(0)).flatten()}
            assert needed <= listed
            assert all(0 <= n < n_r for n in listed)


def test_tile_work_is_close_to_exact_on_a_long_sliding_prefill():
    spec = type(SLIDING_SPEC)(**{**SLIDING_SPEC.__dict__, "window": 64})
    batch = make_batch([Req(0, 1024, frames(10, 8, 40, 20))], spec)
    tiles = varlen_tiles(batch.metadata, spec, 16, 16)
    exact = kept_pairs(batch.metadata, spec)
    dense = 1024 * 1024
    assert exact <= tiles.visited_pairs() < 1.5 * exact < dense / 8
