"""Analysis for benchmarks and tests (no serving path uses it): which (query tile, key tile) pairs of a step can hold a kept pair, derived from mask semantics.

Every query row keeps only keys in [lo, hi]: lo = q - W + 1 (or its range start when the range
term is unclamped), hi = max(q, range end). Each interval contains q itself and a tile's rows are
consecutive positions, so the union over a tile's rows is one interval: a tile needs key tiles
min(lo) // tile_k .. max(hi) // tile_k. A block-sparse kernel visits only those (the minimum tile
work); the element mask still decides inside each visited tile. FA4 with frames visits every tile
of the windowed pieces it is given (`fa4_visited_pairs`), which bench/gpu_check.py and the tests
hold against that minimum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmserve.attention.backend import CommonAttentionMetadata, LayerAttentionSpec
from mmserve.attention.mask import batch_dense_mask, key_bounds, token_request_ids


@dataclass
class VarlenTiles:
    """Per-request tile lists in FA4's varlen block-sparse layout (all int32, on the metadata's device)."""

    cu_total_m_blocks: torch.Tensor   # [R + 1]: cumulative query tiles per request
    cu_block_idx_offsets: torch.Tensor  # [R + 1]: cumulative M_r * N_r slots
    block_cnt: torch.Tensor           # [1, total_m]: key tiles listed per query tile
    block_idx: torch.Tensor           # [1, total_n]: key tile indices, packed left in each N_r slot
    tile_q: int
    tile_k: int

    def visited_pairs(self) -> int:
        """(query, key) pairs a kernel visiting these tiles computes, counting full tiles."""
        return int(self.block_cnt.sum()) * self.tile_q * self.tile_k


def varlen_tiles(md: CommonAttentionMetadata, spec: LayerAttentionSpec, tile_q: int, tile_k: int) -> VarlenTiles:
    """Tile lists for a step; tiles count from each request's first scheduled row and from key 0."""
    qsl = (md.query_start_loc_cpu if md.query_start_loc_cpu is not None else md.query_start_loc).cpu().long()
    seq = (md.seq_lens_cpu if md.seq_lens_cpu is not None else md.seq_lens).cpu().long()
    q_lens = qsl[1:] - qsl[:-1]
    m_per = (q_lens + tile_q - 1) // tile_q
    n_per = (seq + tile_k - 1) // tile_k
    cu_m = torch.cat([torch.zeros(1, dtype=torch.long), m_per.cumsum(0)])
    cu_idx = torch.cat([torch.zeros(1, dtype=torch.long), (m_per * n_per).cumsum(0)])
    total_m, total_n = int(cu_m[-1]), int(cu_idx[-1])
    device = md.positions.device

    T = md.num_actual_tokens
    req = token_request_ids(md.query_start_loc, T)
    local_row = torch.arange(T, device=device) - md.query_start_loc.long()[req]
    tile = cu_m.to(device)[req] + local_row // tile_q
    lo, hi = key_bounds(md, spec)
    n_lo = torch.full((total_m,), 2**62, dtype=torch.long, device=device).scatter_reduce(
        0, tile, lo // tile_k, "amin")
    n_hi = torch.full((total_m,), -1, dtype=torch.long, device=device).scatter_reduce(
        0, tile, hi // tile_k, "amax")
    cnt = (n_hi - n_lo + 1).clamp(min=0)

    tile_req = torch.repeat_interleave(torch.arange(len(m_per)), m_per)
    tile_start = (cu_idx[tile_req] + (torch.arange(total_m) - cu_m[tile_req]) * n_per[tile_req]).to(device)
    slot_tile = torch.repeat_interleave(torch.arange(total_m), n_per[tile_req]).to(device)
    j = torch.arange(total_n, device=device) - tile_start[slot_tile]
    idx = torch.where(j < cnt[slot_tile], n_lo[slot_tile] + j, torch.zeros_like(j))
    return VarlenTiles(cu_m.to(device=device, dtype=torch.int32), cu_idx.to(device=device, dtype=torch.int32),
                       cnt.to(torch.int32)[None], idx.to(torch.int32)[None], tile_q, tile_k)


def kept_pairs(md: CommonAttentionMetadata, spec: LayerAttentionSpec) -> int:
    """Exact number of (query, key) pairs the mask keeps in a step (per head)."""
    return int(batch_dense_mask(md, spec).sum())


def fa4_visited_pairs(md: CommonAttentionMetadata, spec: LayerAttentionSpec, tile_q: int, tile_k: int) -> int:
    """(query, key) pairs FA4 computes for a step with frames: every tile of each windowed piece fa4.py
    hands it (tile_q queries, i.e. FA4's packed rows / g, by tile_k keys)."""
    import numpy as np

    from mmserve.attention.fa4 import piece_len
    from mmserve.attention.page_tables import windowed_pieces

    ranges = None if md.query_ranges_cpu is None or not spec.bidirectional else md.query_ranges_cpu.numpy()
    out = np.zeros((md.num_reqs + md.num_actual_tokens, md.block_table_cpu.shape[1]), dtype=np.int32)
    p = windowed_pieces(spec, md.block_size, md.query_start_loc_cpu.numpy(), md.seq_lens_cpu.numpy(),
                        md.positions_cpu.numpy(), ranges, md.block_table_cpu.numpy(), piece_len(spec), out)
    q_tiles = -(-np.diff(p.query_start_loc).astype(np.int64) // tile_q)
    return int((q_tiles * -(-p.num_keys // tile_k)).sum()) * tile_q * tile_k
