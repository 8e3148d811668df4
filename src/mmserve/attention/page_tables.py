"""Windowed page tables: per request, the page table from the first block any scheduled query row
may keep, plus the absolute position of that table's key 0.

A sliding layer's query at q keeps no key before q - W + 1 (mask.py), and an unclamped range term
reaches back only to the start of the query's own range. So request r's rows [c, s) need keys from

    first_key[r] = max(0, c - W + 1), lowered to the earliest range start among its rows (unclamped)

on (0 on full layers), and its windowed table lists blocks first_key // block_size .. ceil(s / bs).
Local key j of the table is the absolute position key_start[r] + j with key_start[r] =
(first_key[r] // bs) * bs, and the request has num_keys[r] = s - key_start[r] of them. A padded
gather of these tables (the CPU batched path) reads only the window's blocks plus the chunk's.

`windowed_pieces` cuts each request's rows further, into pieces of at most `piece_len` rows, each
with its own windowed table that also ends at the last key its rows keep (q itself, or the end of
q's range). FA4 with a mask_mod visits every key tile of each sequence it is given, so handing it
pieces of one query tile each (with key_start as a per-piece key offset) makes it visit about the
tiles a block-sparse kernel would (issue 19; visited tiles vs the minimum: bench/gpu_check.py).
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
        starts = np.where(range_starts >= 0, range_starts.astype(np.int64), np.iinfo(np.int64).max)
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
    num_blocks = -(-seq_lens.astype(np.int64) // block_size) - first_block
    table = _window_rows(block_table, np.arange(num_reqs), first_block, num_blocks, out)
    key_start = first_block * block_size
    return WindowedTables(table, key_start, seq_lens.astype(np.int64) - key_start, num_blocks)


def _window_rows(block_table: np.ndarray, rows: np.ndarray, first_block: np.ndarray, num_blocks: np.ndarray,
                 out: np.ndarray) -> np.ndarray:
    """out[i, j] = block_table[rows[i], first_block[i] + j] for j < num_blocks[i], else the null block 0."""
    width = int(num_blocks.max())
    cols = first_block[:, None] + np.arange(width)
    table = out[: len(rows), :width]
    table[:] = np.take_along_axis(block_table[rows], np.minimum(cols, block_table.shape[1] - 1), axis=1)
    table[np.arange(width) >= num_blocks[:, None]] = 0
    return table


def key_bounds_np(spec: LayerAttentionSpec, positions: np.ndarray, seq_lens: np.ndarray,
                   ranges: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Inclusive [lo, hi] keys each query row may keep (host int64 arrays; mask.key_bounds is the device twin).

    `seq_lens` per row: its request's context after the step; `ranges` the [T, 2] range table or None.
    """
    q = positions.astype(np.int64)
    lo = np.zeros_like(q) if spec.window is None else np.maximum(q - spec.window + 1, 0)
    hi = q.copy()
    if ranges is not None and spec.bidirectional:
        start, end = ranges[:, 0].astype(np.int64), ranges[:, 1].astype(np.int64)
        inside = start >= 0
        hi = np.where(inside, np.maximum(hi, end), hi)
        if not spec.clamp_bidirectional:
            lo = np.where(inside, np.minimum(lo, start), lo)
    return lo, np.minimum(hi, seq_lens.astype(np.int64) - 1)


@dataclass
class WindowedPieces:
    """One step's pieces (views of a builder's persistent buffers): piece p is rows
    query_start_loc[p]:query_start_loc[p + 1] of the step, all of request `request[p]`."""

    query_start_loc: np.ndarray  # int32 [P + 1]
    request: np.ndarray          # int64 [P]
    first_query: np.ndarray      # int64 [P]: absolute position of the piece's first row
    block_table: np.ndarray      # int32 [P, width]: the request's blocks from key_start on; 0 past them
    key_start: np.ndarray        # int64 [P]: absolute position of local key 0 (a block boundary)
    num_keys: np.ndarray         # int64 [P]: from key_start through the last key one of its rows keeps

    @property
    def num_pieces(self) -> int:
        return len(self.request)


def windowed_pieces(spec: LayerAttentionSpec, block_size: int, query_start_loc: np.ndarray, seq_lens: np.ndarray,
                    positions: np.ndarray, ranges: np.ndarray | None, block_table: np.ndarray, piece_len: int,
                    out: np.ndarray) -> WindowedPieces:
    """Cut each request's scheduled rows into pieces of <= piece_len rows with windowed tables in `out`."""
    num_reqs = len(seq_lens)
    qsl = query_start_loc[: num_reqs + 1].astype(np.int64)
    q_lens = np.diff(qsl)
    lo, hi = key_bounds_np(spec, positions[: qsl[-1]], np.repeat(seq_lens, q_lens), ranges)
    per_req = -(-q_lens // piece_len)
    request = np.repeat(np.arange(num_reqs), per_req)
    starts = qsl[request] + (np.arange(len(request)) - np.repeat(np.cumsum(per_req) - per_req, per_req)) * piece_len
    first_block = np.minimum.reduceat(lo, starts) // block_size
    last_key = np.maximum.reduceat(hi, starts)
    num_blocks = last_key // block_size + 1 - first_block
    table = _window_rows(block_table, request, first_block, num_blocks, out)
    key_start = first_block * block_size
    return WindowedPieces(np.append(starts, qsl[-1]).astype(np.int32), request, positions[starts].astype(np.int64),
                          table, key_start, last_key + 1 - key_start)
