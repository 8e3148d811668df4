"""Windowed page tables: per request, the page table from the first block any scheduled query row
may keep, plus the absolute position of that table's key 0.

A sliding layer's query at q keeps no key before q - W + 1 (mask.py), and an unclamped range term
reaches back only to the start of the query's own range. So request r's rows [c, s) need keys from

    first_key[r] = max(0, c - W + 1), lowered to the earliest range start among its rows (unclamped)

on (0 on full layers), and its windowed table lists blocks first_key // block_size .. ceil(s / bs).
Local key j of the table is the absolute position key_start[r] + j with key_start[r] =
(first_key[r] // bs) * bs, and the request has num_keys[r] = s - key_start[r] of them. A padded
gather of these tables (the CPU batched path) and a kernel's page table (FA4 tile skipping, issue
19, with key_start as a per-request key offset) read only the window's blocks plus the chunk's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mmserve.attention.backend import LayerAttentionSpec


def first_kept_keys(spec: LayerAttentionSpec, query_start_loc: np.ndarray, seq_lens: np.ndarray,
                    range_starts: np.ndarray | None) -> np.ndarray:
    """Per request, the oldest absolute key any of its scheduled rows keeps (int64 [R]).

    `range_starts` is column 0 of the per-token range table (-1 outside a range) or None.
    """
    num_reqs = len(seq_lens)
    q_lens = np.diff(query_start_loc[:num_reqs + 1]).astype(np.int64)
    first_query = seq_lens.astype(np.int64) - q_lens
    if spec.window is None:
        first = np.zeros(num_reqs, dtype=np.int64)
    else:
        first = np.maximum(first_query - spec.window + 1, 0)
    if range_starts is not None and spec.bidirectional and not spec.clamp_bidirectional:
        starts = np.where(range_starts >= 0, range_starts, np.iinfo(np.int64).max).astype(np.int64)
        earliest = np.minimum.reduceat(starts, query_start_loc[:num_reqs].astype(np.int64))
        first = np.minimum(first, earliest)
    return first


@dataclass
class WindowedTables:
    """Host arrays of one step's windowed page tables (views of a builder's persistent buffers)."""

    block_table: np.ndarray    # int32 [R, width]: windowed[r, j] = block_table[r, first_block[r] + j]; 0 past num_blocks[r]
    key_start: np.ndarray      # int64 [R]: absolute position of local key 0 (a block boundary)
    num_keys: np.ndarray       # int64 [R]: seq_len - key_start
    num_blocks: np.ndarray     # int64 [R]: used entries of each row

    @property
    def width(self) -> int:
        return self.block_table.shape[1]


def windowed_tables(spec: LayerAttentionSpec, block_size: int, query_start_loc: np.ndarray, seq_lens: np.ndarray,
                    block_table: np.ndarray, range_starts: np.ndarray | None, out: np.ndarray) -> WindowedTables:
    """Fill `out` (int32 [>= R, >= width]) with each request's windowed table; width = the widest row."""
    num_reqs = len(seq_lens)
    first_block = first_kept_keys(spec, query_start_loc, seq_lens, range_starts) // block_size
    end_block = -(-seq_lens.astype(np.int64) // block_size)
    num_blocks = end_block - first_block
    width = int(num_blocks.max())
    cols = first_block[:, None] + np.arange(width)
    table = out[:num_reqs, :width]
    table[:] = np.take_along_axis(block_table[:num_reqs], np.minimum(cols, block_table.shape[1] - 1), axis=1)
    table[np.arange(width) >= num_blocks[:, None]] = 0
    key_start = first_block * block_size
    return WindowedTables(table, key_start, seq_lens.astype(np.int64) - key_start, num_blocks)
