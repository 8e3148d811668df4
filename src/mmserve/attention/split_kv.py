"""Split-KV attention for decode and verify steps over the paged cache (our Triton kernel,
attention/split_kv_kernels.py).

Why: a decode step has one query token per request (a verify step K + 1), so a kernel that runs one
program per (request, KV head) runs one program per full layer at batch 1 on Gemma 4's 12B (1 KV
head): one SM streams the whole context while the other 131 idle. Here each request's keys are cut
into splits, one program per (query tile, KV head, split), and the split that finishes last merges
the splits' partial outputs by their log-sum-exp (flash-decoding in one launch). The heads sharing
a KV head are packed into one tile's rows (GROUP consecutive rows per query token), so each split's
keys are read once per KV head.

How many splits (`SplitKvPlanner.plan`, on the host from the step's host mirrors, no device sync):
- the grid's split count `max_splits` depends only on the step's shape (requests, rows per request,
  KV heads), so a CUDA graph captured for a batch size replays with the same grid: enough programs
  to cover the device twice over (`programs`), at most MAX_SPLITS, and no more partial rows than the
  planner's workspace holds;
- each request then takes as many of them as give every split at least `min_split_keys` keys
  (partial outputs cost g x 4 bytes per head dim and split against 4 bytes per key and head dim of
  K/V read: at 128 keys and g = 16 the partials add an eighth to the K/V traffic, and they only
  exist where the request's keys would otherwise leave the GPU idle);
- one split in the grid (large batches) writes the output directly: no partials, no merge.
Either way a layer is one launch.

Keys start at the oldest key any of the request's rows keeps (`page_tables.first_kept_keys`: the
window, or an unclamped frame's start), so a sliding layer reads its window, not the context.
The mask is mask.keep per (row, key) inside the kernel, with the rows' ranges when the step has
them, so any step is computed exactly; only steps of at most MAX_QUERY_LEN rows per request are
worth it (`decode_shaped`), longer chunks take the layer type's prefill kernel.

Every tensor the kernels read is the runner's persistent step buffers or this planner's (refilled
in place), and the grid and every scalar are fixed by the step's shape: decode and verify steps
replay as CUDA graphs. Which layer types use it on which GPU: attention/selection.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from mmserve.attention.backend import CommonAttentionMetadata, LayerAttentionSpec, PoolConfig
from mmserve.attention.buffers import StagedBuffer
from mmserve.attention.mask import NO_WINDOW
from mmserve.attention.page_tables import first_kept_keys

MAX_QUERY_LEN = 16      # rows per request of a decode-shaped step: decode, and verify chunks of up to 15 drafts
MIN_SPLIT_KEYS = 128    # keys per split at least (the partials' traffic against the keys', module doc)
MAX_SPLITS = 128
CPU_PROGRAMS = 16       # programs to aim for where there is no SM count (Triton's interpreter on a CPU)


def decode_shaped(common: CommonAttentionMetadata) -> bool:
    return common.max_query_len <= MAX_QUERY_LEN


def tile_shape(head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): 16 packed rows (tl.dot's least; a decode token of a 16-head group fills
    them) by 32 keys at head dim 512 (a 32 KiB K tile and V tile in bf16), 64 keys below."""
    return 16, 32 if head_dim > 256 else 64


def default_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_PROGRAMS


@dataclass
class SplitKvMetadata:
    """One step's split-KV plan (device tensors are views of persistent buffers)."""

    common: CommonAttentionMetadata
    ranges: torch.Tensor            # int32 [>= T, 2]: the step's range table, or the planner's all (-1, -1)
    key_lo: torch.Tensor            # int32 [R]: each request's first key to read
    num_splits: torch.Tensor        # int32 [R]: splits of each request (<= max_splits)
    split_len: torch.Tensor         # int32 [R]: keys per split
    partials: torch.Tensor          # float32 [max_splits, T, H, D] (unused with one split)
    lse: torch.Tensor               # float32 [max_splits, T, H]
    counters: torch.Tensor          # int32 [>= R * tiles_per_req * Hkv]: splits done per (tile, KV head), 0 between launches
    tiles_per_req: int              # query tiles of BLOCK_M packed rows per request
    max_splits: int                 # the grid's split axis


class SplitKvPlanner:
    """Per pool: the persistent buffers of the split-KV kernel and the per-step split plan."""

    def __init__(self, pool: PoolConfig, *, programs: int | None = None, min_split_keys: int = MIN_SPLIT_KEYS):
        spec = self.spec = pool.spec
        self.group = spec.num_heads // spec.num_kv_heads
        self.block_m, self.block_n = tile_shape(spec.head_dim)
        self.programs = programs or default_programs(pool.device)
        self.min_split_tiles = max(1, min_split_keys // self.block_n)
        self.position_slack = pool.position_slack
        max_tokens = min(pool.max_num_tokens, pool.max_num_reqs * MAX_QUERY_LEN)
        self.key_lo = StagedBuffer((pool.max_num_reqs,), torch.int32, pool.device)
        self.num_splits = StagedBuffer((pool.max_num_reqs,), torch.int32, pool.device)
        self.split_len = StagedBuffer((pool.max_num_reqs,), torch.int32, pool.device)
        self.no_ranges = torch.full((max_tokens, 2), -1, dtype=torch.int32, device=pool.device)
        max_tiles = -(-MAX_QUERY_LEN * self.group // self.block_m)
        self.counters = torch.zeros(pool.max_num_reqs * max_tiles * spec.num_kv_heads, dtype=torch.int32,
                                    device=pool.device)
        # partial rows (token, head, split) of head_dim floats: what `programs` programs of full tiles write
        self.workspace_rows = 2 * self.programs * self.block_m
        self.workspace = torch.empty(self.workspace_rows * (spec.head_dim + 1), dtype=torch.float32,
                                     device=pool.device)

    def plan(self, common: CommonAttentionMetadata) -> SplitKvMetadata:
        spec, R, T = self.spec, common.num_reqs, common.num_actual_tokens
        qsl = common.query_start_loc_cpu.numpy()[: R + 1]
        seq_lens = common.seq_lens_cpu.numpy()[:R].astype(np.int64)
        with_ranges = common.query_ranges is not None and spec.bidirectional
        starts = common.query_ranges_cpu.numpy()[:T, 0] if with_ranges else None
        # the kernel masks the window by each row's device position: starting early only reads a tile more
        key_lo = np.maximum(first_kept_keys(spec, qsl, seq_lens, starts) - self.position_slack, 0)

        tiles_per_req = max(1, -(-common.max_query_len * self.group // self.block_m))
        per_split = max(1, R * spec.num_kv_heads * tiles_per_req)
        max_splits = min(MAX_SPLITS, -(-self.programs // per_split), self.workspace_rows // max(1, T * spec.num_heads))
        max_splits = max(1, max_splits)
        tiles = -(-(seq_lens - key_lo) // self.block_n)
        splits = np.clip(tiles // self.min_split_tiles, 1, max_splits)
        split_tiles = np.maximum(1, -(-tiles // splits))
        self.key_lo.np[:R] = key_lo
        self.num_splits.np[:R] = np.maximum(1, -(-tiles // split_tiles))
        self.split_len.np[:R] = split_tiles * self.block_n

        H, D = spec.num_heads, spec.head_dim
        rows = T * H if max_splits > 1 else 0   # one split writes the output directly: no partials
        partials = self.workspace[: max_splits * rows * D].view(-1, T, H, D)
        lse_at = self.workspace_rows * D
        lse = self.workspace[lse_at: lse_at + max_splits * rows].view(-1, T, H)
        return SplitKvMetadata(common, common.query_ranges if with_ranges else self.no_ranges,
                               self.key_lo.push(R), self.num_splits.push(R), self.split_len.push(R),
                               partials, lse, self.counters, tiles_per_req, max_splits)


def planner_for(pool: PoolConfig, backend: str) -> SplitKvPlanner | None:
    """The split-KV planner of a `backend` builder's pool, or None where its decode steps stay its own."""
    from mmserve.attention.selection import device_arch, split_kv_decode

    use = pool.split_kv_decode
    if use is None:
        use = split_kv_decode(backend, pool.device.type, device_arch(pool.device))
    return SplitKvPlanner(pool) if use else None


def split_kv_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: SplitKvMetadata,
                       spec: LayerAttentionSpec) -> torch.Tensor:
    """q [>= T, H, D] (rows past the step's tokens are padding) over the paged caches
    ([blocks, block_size, Hkv, D] each) -> [q rows, H, D] in q's dtype."""
    from mmserve.attention.split_kv_kernels import attend_splits

    c = md.common
    q = q if q.stride(-1) == 1 else q.contiguous()
    T, H, D = c.num_actual_tokens, q.shape[1], q.shape[2]
    group, Hkv = H // k_cache.shape[2], k_cache.shape[2]
    block_m, block_n = tile_shape(D)
    out = torch.empty_like(q)
    if T == 0:
        return out
    direct = md.max_splits == 1
    grid = (c.num_reqs * md.tiles_per_req, Hkv, md.max_splits)
    window = spec.window if spec.window is not None else NO_WINDOW
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    d_pad = max(16, 1 << (D - 1).bit_length())
    stride_ps = T * H * D
    attend_splits[grid](
        q, k_cache, v_cache, out, md.partials, md.lse, md.counters,
        c.query_start_loc, c.seq_lens, c.positions, md.ranges, c.block_table, md.key_lo, md.num_splits, md.split_len,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0),
        out.stride(1), c.block_table.stride(0), stride_ps, H, md.tiles_per_req, c.block_size, window,
        int(spec.clamp_bidirectional), spec.scale * math.log2(math.e),
        GROUP=group, HEAD_DIM=D, HEAD_DIM_PAD=d_pad, BLOCK_M=block_m, BLOCK_N=block_n, DIRECT=direct,
        PRECISION=precision)
    return out
