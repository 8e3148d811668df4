"""Windowed pieces (what FA4 is given with frames) hold every key their rows keep and map local keys
to the request's blocks (fresh random steps against the dense mask of mask.py); FA4's arithmetic on
the builder's pieces, emulated in torch, gives the reference output; and the tile work it costs."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from attn_batches import SPECS, Req, frames, make_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))   # tile_analysis (analysis code, not serving)
from mmserve.attention.backend import SLIDING, LayerAttentionSpec
from mmserve.attention.mask import batch_dense_mask
from mmserve.attention.page_tables import windowed_pieces, windowed_tables


def random_step(gen: torch.Generator) -> list[Req]:
    def r(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=gen))
    return [Req(r(0, 60), r(1, 50), frames(r(0, 10), r(0, 5), r(2, 20), r(0, 4))) for _ in range(r(1, 5))]


def pieces_of(batch, spec, piece_len: int):
    md = batch.metadata
    ranges = None if md.query_ranges_cpu is None or not spec.bidirectional else md.query_ranges_cpu.numpy()
    out = np.zeros((64, 64), dtype=np.int32)
    return windowed_pieces(spec, md.block_size, md.query_start_loc_cpu.numpy(), md.seq_lens_cpu.numpy(),
                           md.positions_cpu.numpy(), ranges, md.block_table_cpu.numpy(), piece_len, out)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.layer_type}-clamp{s.clamp_bidirectional}-bidi{s.bidirectional}")
def test_pieces_hold_every_kept_key_and_map_to_the_requests_blocks(spec):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    for _ in range(20):
        batch = make_batch(random_step(gen), spec, num_blocks=160, block_size=4, gen=gen)
        md = batch.metadata
        mask = batch_dense_mask(md, spec).numpy()
        table = md.block_table_cpu.numpy()
        for piece_len in (3, 16, 1000):
            p = pieces_of(batch, spec, piece_len)
            qsl = p.query_start_loc
            assert qsl[0] == 0 and qsl[-1] == md.num_actual_tokens and (np.diff(qsl) <= piece_len).all()
            for i in range(p.num_pieces):
                r, start = p.request[i], p.key_start[i]
                kept = np.flatnonzero(mask[qsl[i]: qsl[i + 1]].any(0))
                assert kept.size == 0 or (kept.min() >= start and kept.max() < start + p.num_keys[i])
                assert start % 4 == 0 and start + p.num_keys[i] <= md.seq_lens_cpu[r]
                blocks = -(-(start + p.num_keys[i]) // 4) - start // 4
                assert (p.block_table[i, :blocks] == table[r, start // 4: start // 4 + blocks]).all()
                assert (p.block_table[i, blocks:] == 0).all()
                assert p.first_query[i] == md.positions_cpu[qsl[i]]


def test_whole_request_pieces_are_the_windowed_tables():
    spec = SPECS[1]   # sliding, unclamped: the window's start or the earliest frame start in reach
    gen = torch.Generator().manual_seed(5)
    batch = make_batch([Req(30, 20, [(20, 40)]), Req(3, 4), Req(50, 1)], spec, num_blocks=64, block_size=4, gen=gen)
    md = batch.metadata
    p = pieces_of(batch, spec, 1000)
    t = windowed_tables(spec, 4, md.query_start_loc_cpu.numpy(), md.seq_lens_cpu.numpy(), md.block_table_cpu.numpy(),
                        md.query_ranges_cpu.numpy()[:, 0], np.zeros((8, 32), dtype=np.int32))
    assert (p.key_start == t.key_start).all() and (p.num_keys == t.num_keys).all()
    assert (p.block_table == t.block_table).all()


@pytest.mark.parametrize("budget", [512, 2048])
def test_fa4_visits_at_most_1_3x_the_minimum_tile_work_at_64_frames(budget):
    """The last chunk of a 64-frame video (Gemma 4: 70 soft tokens a frame, window 1024, 2 query heads per
    KV head): FA4's tiles over the windowed pieces against the block-sparse minimum, SM90 and SM100 tiles."""
    from tile_analysis import fa4_visited_pairs, varlen_tiles

    spec = replace(SPECS[0], num_heads=2, num_kv_heads=1, head_dim=8, window=1024)   # tiles ignore head dim
    ranges = frames(20, 64, 70, 8)
    prompt = ranges[-1][1] + 13
    batch = make_batch([Req(prompt - budget, budget, ranges)], spec, num_blocks=-(-prompt // 16) + 8)
    md = batch.metadata
    for tile_q, tile_k in ((64, 80), (64, 128)):   # FA4 b36 at head dim 256: SM90, SM100 (128 packed rows)
        minimum = varlen_tiles(md, spec, tile_q, tile_k).visited_pairs()
        assert fa4_visited_pairs(md, spec, tile_q, tile_k) <= 1.3 * minimum
    whole_keys = budget * prompt     # what FA4 visited before: every key of [0, seq_len) for every row
    assert fa4_visited_pairs(md, spec, 64, 128) < whole_keys / 3


def emulate_fa4(q: torch.Tensor, kv_cache: torch.Tensor, md, spec: LayerAttentionSpec) -> torch.Tensor:
    """What FA4 computes from our metadata, in plain torch: for each piece, local query i and local key j
    (page j // bs of its table) with the offsets mask_mod's arithmetic and mask.keep. Checks the
    builder's tables and offsets on CPU; the CuTe mask_mod itself is checked on a GPU (gpu tests)."""
    from mmserve.attention.mask import keep_for_spec
    from mmserve.attention.reference import dense_attention

    p, ranges = md.pieces, md.common.query_ranges
    bs = kv_cache.shape[2]
    out = torch.zeros_like(q)
    for i in range(len(p.num_keys)):
        rows = slice(int(p.query_start_loc[i]), int(p.query_start_loc[i + 1]))
        j = torch.arange(int(p.num_keys[i]))
        blocks = p.block_table[i, j // bs].long()
        keys, values = kv_cache[0][blocks, j % bs], kv_cache[1][blocks, j % bs]
        q_abs = p.offsets[i, 0] + torch.arange(rows.stop - rows.start)
        k_abs = p.offsets[i, 1] + j
        r = ranges[rows].long()
        mask = keep_for_spec(q_abs[:, None], k_abs[None], r[:, :1], r[:, 1:], spec)
        out[rows] = dense_attention(q[rows], keys, values, mask, spec.scale).to(q.dtype)
    return out


@pytest.mark.parametrize("clamp", [True, False])
def test_pieces_metadata_gives_the_reference_output(monkeypatch, clamp):
    from attn_batches import standard_batches

    from mmserve.attention.fa4 import Fa4MetadataBuilder, piece_len
    from mmserve.attention.synthetic import pool_for, run_backend

    monkeypatch.setenv("FLASH_ATTENTION_ARCH", "sm_90")    # the builder plans as on an H100; nothing runs FA4
    # 16 query heads per KV head: pieces of 8 rows, so requests span several pieces
    spec = LayerAttentionSpec(SLIDING, 32, 2, 16, window=8, bidirectional=True, clamp_bidirectional=clamp)
    gen = torch.Generator().manual_seed(3)
    for name, reqs in standard_batches().items():
        batch = make_batch(reqs, spec, gen=gen, free_outside_window=True)
        if batch.metadata.query_ranges is None:
            continue
        pool = replace(pool_for(batch, spec), dtype=torch.bfloat16)
        md = Fa4MetadataBuilder(pool).build(batch.metadata)
        assert md.pieces is not None and md.pieces.max_query_len <= piece_len(spec) == 8
        want, cache = run_backend("reference", batch, spec)
        got = emulate_fa4(batch.q, cache, md, spec)
        assert (got - want).abs().max() < 1e-5, name
