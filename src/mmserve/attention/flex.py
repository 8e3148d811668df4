"""FlexAttention over the whole paged cache, compiled once per layer type.

The key sequence is the cache itself (every physical slot); the mask_mod maps a physical slot to
its logical position through per-step tables and applies mask.keep. All per-step data (positions,
ranges, block tables) lives in fixed-capacity tensors that are refilled in place, so new frame
counts or batch compositions never change what dynamo guards on. Query rows are padded to a fixed
row capacity for the same reason.

GQA is packed into rows, one request per query block: the g query heads sharing a KV head are g
consecutive rows of that KV head (token t's head j at row tok_row[t] + j), each request's rows
start on a 16-row query block, and flex runs with as many heads as KV heads. Triton's flex kernel
runs one program per (query block, head), each reading every block its list names: with the heads
unpacked, each of the g query heads re-read its KV head's blocks, and a decode query block of 16
tokens of 16 requests listed all their blocks. Packed, a decode step reads each request's blocks
once per KV head (its 16 - g padding rows are free in a memory-bound step), a prefill chunk no
more than before.

The block mask lists, per query block, only the physical blocks some row can keep: every row keeps
one interval of keys (mask.key_bounds: its window and its frame), a block's rows are consecutive
tokens of one request, so its blocks are one interval of that request's table, split into the
interior every row keeps whole (listed as full: no mask_mod) and the edges. Both lists are gathered
from the table on the device, O(query blocks x table width): no cache-wide matrix, no sort.

On CUDA this is the batched path for layer types FA4 cannot run (Gemma 4's head-dim-512 full
layers; attention/selection.py): it reads K/V in place, and every tensor it reads (padded query,
block mask, tables) is a persistent buffer refilled each step, so decode steps can be CUDA graphs.
Triton's kernel tile must divide the block mask's blocks, so it runs 16x16 tiles (one query block
by one 16-token page); with head dim 512 that is 16 KiB of K and of V per pipeline stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from mmserve.attention.backend import (
    AttentionBackend,
    CommonAttentionMetadata,
    LayerAttentionSpec,
    PoolConfig,
)
from mmserve.attention.buffers import StagedBuffer
from mmserve.attention.mask import NO_WINDOW, keep, key_bounds, token_request_ids
from mmserve.attention.paged import write_kv
from mmserve.attention.split_kv import SplitKvMetadata, decode_shaped, planner_for, split_kv_attention

Q_BLOCK = 16        # query rows per block-mask block (and Triton's BLOCK_M on CUDA)
KV_TILE = 16        # Triton's key tile on CUDA: must divide the cache block size
MIN_BLOCKS_PER_REQ = 64
# One graph per (layer type, dtype, head dim, capacity) shares flex_attention's frame; leave room.
torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
_compiled_flex = torch.compile(flex_attention, dynamic=False)


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


@dataclass
class StepTables:
    """Fixed-capacity per-step tensors the mask_mod reads; refilled in place every step."""

    q_pos: torch.Tensor        # int32 [Q]; -1 on padded rows
    q_req: torch.Tensor        # int32 [Q]
    r_start: torch.Tensor      # int32 [Q]; -1 outside a range
    r_end: torch.Tensor        # int32 [Q]
    seq_lens: torch.Tensor     # int32 [R]
    block_table: torch.Tensor  # int32 [R, MB]
    logical_block: torch.Tensor  # int32 [num_cache_blocks]; -1 where no request of the step uses it
    window: torch.Tensor       # int32 0-d; the layer's window (2**30 on full layers)
    clamp: torch.Tensor        # bool 0-d; the range term also obeys the window

    @classmethod
    def allocate(cls, spec: LayerAttentionSpec, tokens: int, reqs: int, blocks_per_req: int, cache_blocks: int,
                 device) -> StepTables:
        def buf(*shape):
            return torch.zeros(shape, dtype=torch.int32, device=device)
        window = torch.tensor(spec.window if spec.window is not None else NO_WINDOW, dtype=torch.int32, device=device)
        clamp = torch.tensor(spec.clamp_bidirectional, device=device)
        return cls(buf(tokens), buf(tokens), buf(tokens), buf(tokens), buf(reqs), buf(reqs, blocks_per_req),
                   buf(cache_blocks), window, clamp)


def make_mask_mod(t: StepTables, row_tok: torch.Tensor, block_size: int):
    """mask.keep on physical cache slots; reads per-step data only from `t`'s tensors and `row_tok`
    (the token of each packed query row; padding rows name a token whose position is -1).

    The range term is always on: layers without bidirectional attention get (-1, -1) rows, so one
    graph serves every window, clamp and bidirectional setting of a head dim and dtype.
    """

    def paged_keep(b, h, q_idx, kv_idx):
        tok = row_tok[q_idx]
        phys = kv_idx // block_size
        lb = t.logical_block[phys]
        req = t.q_req[tok]
        k = lb * block_size + kv_idx % block_size
        owned = (lb >= 0) & (t.block_table[req, lb.clamp(min=0)] == phys) & (k < t.seq_lens[req])
        return owned & keep(t.q_pos[tok], k, t.r_start[tok], t.r_end[tok],
                            window=t.window, bidirectional=True, clamp=t.clamp)

    return paged_keep


@dataclass
class FlexMetadata:
    common: CommonAttentionMetadata
    block_mask: BlockMask         # over the builder's persistent block lists
    q_pad: torch.Tensor           # [1, Hkv, row capacity, D]: every call's query, packed (fixed: one compile)
    head_rows: torch.Tensor       # int64 [token capacity * g]: the packed row of (token, head in its group)


def cuda_kernel_options(head_dim: int) -> dict:
    """Triton tiles of one query block by KV_TILE keys; two pipeline stages keep head dim 512 in shared memory."""
    options = {"BLOCK_M": Q_BLOCK, "BLOCK_N": KV_TILE, "FORCE_USE_FLEX_ATTENTION": True}
    if head_dim > 256:
        options["num_stages"] = 2
    return options


class FlexMetadataBuilder:
    """Refills the fixed-capacity tables and builds the step's block mask, once per step per layer type;
    on CUDA, decode and verify steps are planned for the split-KV kernel instead (attention/split_kv.py)."""

    def __init__(self, pool: PoolConfig) -> None:
        self.split_kv = planner_for(pool, "flex")
        spec = self.spec = pool.spec
        self.block_size = pool.block_size
        self.group = g = spec.num_heads // spec.num_kv_heads
        self.num_padded_tokens = _pow2_at_least(pool.max_num_tokens, Q_BLOCK)
        # Every request's rows start a query block: at most max_num_reqs blocks' worth of padding rows.
        self.num_rows = -(-(self.num_padded_tokens * g + pool.max_num_reqs * (Q_BLOCK - 1)) // Q_BLOCK) * Q_BLOCK
        self.pad_token = self.num_padded_tokens   # a table row whose position stays -1: padding rows' token
        self.tables = StepTables.allocate(spec, self.num_padded_tokens + 1, pool.max_num_reqs,
                                          _pow2_at_least(pool.max_blocks_per_req, MIN_BLOCKS_PER_REQ),
                                          pool.num_blocks, pool.device)
        num_q_blocks = self.num_rows // Q_BLOCK
        self.row_tok = StagedBuffer((self.num_rows,), torch.int32, pool.device)
        self.head_rows = StagedBuffer((self.num_padded_tokens * g,), torch.int64, pool.device)
        self.tok_row = StagedBuffer((self.num_padded_tokens,), torch.int64, pool.device)
        self.block_owner = StagedBuffer((num_q_blocks,), torch.int64, pool.device)
        self._rows_for: bytes | None = None   # the query_start_loc (its bytes) the row layout was last built for
        self._rows_q_blocks = 0
        self.mask_mod = make_mask_mod(self.tables, self.row_tok.dev, pool.block_size)
        if pool.device.type == "cuda" and pool.block_size % KV_TILE:
            raise ValueError(f"flex on CUDA needs a block size that is a multiple of {KV_TILE} (got {pool.block_size})")
        self.q_pad = torch.zeros(1, spec.num_kv_heads, self.num_rows, spec.head_dim, dtype=pool.dtype,
                                 device=pool.device)
        lists = [torch.zeros(shape, dtype=torch.int32, device=pool.device)
                 for shape in ((1, 1, num_q_blocks), (1, 1, num_q_blocks, pool.num_blocks)) * 2]
        self.block_mask = BlockMask.from_kv_blocks(*lists, BLOCK_SIZE=(Q_BLOCK, pool.block_size), mask_mod=self.mask_mod,
                                                   seq_lengths=(self.num_rows, pool.num_blocks * pool.block_size),
                                                   compute_q_blocks=False)

    def build(self, common: CommonAttentionMetadata) -> FlexMetadata | SplitKvMetadata:
        if self.split_kv is not None and decode_shaped(common):
            return self.split_kv.plan(common)
        t = self.tables
        if (common.num_actual_tokens > self.num_padded_tokens or common.num_reqs > t.seq_lens.shape[0]
                or common.block_table.shape[1] > t.block_table.shape[1]):
            raise ValueError(f"flex: a step of {common.num_actual_tokens} tokens, {common.num_reqs} requests and "
                             f"{common.block_table.shape[1]} blocks per request exceeds the builder's capacity")
        self._fill_tables(common)
        num_q_blocks = self._fill_rows(common)
        self._fill_block_mask(common, num_q_blocks)
        return FlexMetadata(common, self.block_mask, self.q_pad, self.head_rows.dev)

    def _fill_tables(self, md: CommonAttentionMetadata) -> None:
        T, R = md.num_actual_tokens, md.num_reqs
        t = self.tables
        t.q_pos.fill_(-1)
        t.q_pos[:T] = md.positions[:T]
        t.q_req.zero_()
        t.q_req[:T] = token_request_ids(md.query_start_loc, T).to(torch.int32)
        t.r_start.fill_(-1)
        t.r_end.fill_(-1)
        if md.query_ranges is not None and self.spec.bidirectional:
            t.r_start[:T] = md.query_ranges[:T, 0]
            t.r_end[:T] = md.query_ranges[:T, 1]
        t.seq_lens.zero_()
        t.seq_lens[:R] = md.seq_lens[:R]
        t.block_table.zero_()
        t.block_table[:R, : md.block_table.shape[1]] = md.block_table[:R]
        # Physical -> logical block; unused table entries point at the null block 0, forced to -1 after.
        t.logical_block.fill_(-1)
        logical = torch.arange(md.block_table.shape[1], dtype=torch.int32, device=t.logical_block.device)
        t.logical_block.index_put_((md.block_table[:R].long(),), logical.expand(R, -1))
        t.logical_block[0] = -1

    def _fill_rows(self, md: CommonAttentionMetadata) -> int:
        """The packed row layout, planned on the host mirror of query_start_loc: each request's
        tokens x g rows from a query-block boundary. Returns the step's query blocks. The layout is
        a function of query_start_loc alone and only this method writes its buffers, so a step
        whose query lengths repeat the last one's (steady decode, uniform verify steps) keeps it."""
        T, R, g = md.num_actual_tokens, md.num_reqs, self.group
        starts = md.query_start_loc_cpu.numpy()[: R + 1]
        key = starts.tobytes()
        if key == self._rows_for:
            return self._rows_q_blocks
        qsl = starts.astype(np.int64)
        rows_per_req = -(-np.diff(qsl) * g // Q_BLOCK) * Q_BLOCK
        row_start = np.concatenate(([0], np.cumsum(rows_per_req)))
        num_q_blocks = int(row_start[-1]) // Q_BLOCK
        req = np.repeat(np.arange(R), np.diff(qsl))
        tok_row = self.tok_row.np[:T]
        tok_row[:] = row_start[req] + (np.arange(T) - qsl[req]) * g            # row of each token's head 0
        heads = self.head_rows.np
        heads[:] = 0                                                           # padding tokens: any row
        heads[: T * g] = (tok_row[:, None] + np.arange(g)).reshape(-1)
        self.row_tok.np[:] = self.pad_token
        self.row_tok.np[heads[: T * g]] = np.repeat(np.arange(T), g)
        self.block_owner.np[:num_q_blocks] = np.repeat(np.arange(R), rows_per_req // Q_BLOCK)
        self.row_tok.push(self.num_rows)
        self.head_rows.push(heads.shape[0])
        self.block_owner.push(num_q_blocks)
        self.tok_row.push(T)
        self._rows_for, self._rows_q_blocks = key, num_q_blocks
        return num_q_blocks

    def _fill_block_mask(self, md: CommonAttentionMetadata, num_q_blocks: int) -> None:
        """Per query block, the blocks of its request's table from the lowest key a row keeps to
        the highest: full where every row keeps the whole block, else partial; the lists of the
        blocks past this step's are emptied."""
        mask = self.block_mask
        for count in (mask.kv_num_blocks, mask.full_kv_num_blocks):
            count.zero_()
        T, bs, g = md.num_actual_tokens, md.block_size, self.group
        if T == 0:
            return
        device = md.positions.device
        lo_key, hi_key = key_bounds(md, self.spec)                         # [T] inclusive, per token
        tok_row = self.tok_row.dev[:T]
        spans = [torch.minimum(tok_row // Q_BLOCK + k, (tok_row + g - 1) // Q_BLOCK)
                 for k in range((g - 1) // Q_BLOCK + 2)]                         # each token's query blocks
        q_block = torch.cat(spans)

        def per_block(values: torch.Tensor, fill: int, reduce: str) -> torch.Tensor:
            start = torch.full((num_q_blocks,), fill, dtype=torch.long, device=device)
            return start.scatter_reduce(0, q_block, values.repeat(len(spans)), reduce)
        big = 2**62
        union_lo, union_hi = per_block(lo_key, big, "amin") // bs, per_block(hi_key, -1, "amax") // bs
        full_lo = (per_block(lo_key, -1, "amax") + bs - 1) // bs                 # every row keeps these whole
        full_hi = (per_block(hi_key, big, "amin") + 1) // bs - 1
        owner = self.block_owner.dev[:num_q_blocks]
        tables = md.block_table[: md.num_reqs].long()
        width = tables.shape[1]
        # A null entry (0) inside the interior cannot go unmasked: such a block lists it all as partial.
        nulls = torch.nn.functional.pad(torch.cumsum(tables == 0, 1), (1, 0))    # [R, width + 1]
        interior = (full_hi >= full_lo) & (
            nulls[owner, (full_hi + 1).clamp(0, width)] == nulls[owner, full_lo.clamp(0, width)])
        full_lo = torch.where(interior, full_lo, union_hi + 1)
        full_hi = torch.where(interior, full_hi, union_hi)
        left = (torch.minimum(full_lo - 1, union_hi) - union_lo + 1).clamp(min=0)
        right = (union_hi - full_hi).clamp(min=0)
        cols = min(width, mask.kv_indices.shape[-1])
        i = torch.arange(cols, device=device)[None, :]
        own = tables[owner]                                                    # [num_q_blocks, width]
        partial = torch.where(i < left[:, None], union_lo[:, None] + i, full_hi[:, None] + 1 + i - left[:, None])
        full = full_lo[:, None] + i
        mask.kv_num_blocks[0, 0, :num_q_blocks] = (left + right).to(torch.int32)
        mask.full_kv_num_blocks[0, 0, :num_q_blocks] = (full_hi - full_lo + 1).clamp(min=0).to(torch.int32)
        mask.kv_indices[0, 0, :num_q_blocks, :cols] = own.gather(1, partial.clamp(0, width - 1)).to(torch.int32)
        mask.full_kv_indices[0, 0, :num_q_blocks, :cols] = own.gather(1, full.clamp(0, width - 1)).to(torch.int32)


class FlexImpl:
    """AttentionImpl on compiled flex_attention over the whole paged cache (or the split-KV kernel,
    when the builder planned the step for them)."""

    def __init__(self, spec: LayerAttentionSpec) -> None:
        self.spec = spec

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv_cache: torch.Tensor,
                metadata: FlexMetadata | SplitKvMetadata) -> torch.Tensor:
        write_kv(kv_cache, k, v, metadata.common)
        if isinstance(metadata, SplitKvMetadata):
            return split_kv_attention(q, kv_cache[0], kv_cache[1], metadata, self.spec)
        T, n = metadata.common.num_actual_tokens, q.shape[0]   # rows past T: padding (graph steps)
        H, D = q.shape[1], q.shape[2]
        num_blocks, block_size, Hkv = kv_cache.shape[1], kv_cache.shape[2], kv_cache.shape[3]
        g = H // Hkv
        q_pad = metadata.q_pad[0]   # rows no token owns hold old queries; no list names them
        q_pad.index_copy_(1, metadata.head_rows[: T * g], q[:T].view(T, Hkv, g, D).transpose(0, 1).reshape(Hkv, -1, D))
        keys = kv_cache[0].view(num_blocks * block_size, Hkv, D).transpose(0, 1)[None]
        values = kv_cache[1].view(num_blocks * block_size, Hkv, D).transpose(0, 1)[None]
        out = _compiled_flex(q_pad[None], keys, values, block_mask=metadata.block_mask, scale=self.spec.scale,
                             kernel_options=cuda_kernel_options(D) if q.is_cuda else None)
        rows = out[0].index_select(1, metadata.head_rows[: n * g])             # [Hkv, n * g, D]
        return rows.view(Hkv, n, g, D).transpose(0, 1).reshape(n, H, D)


BACKEND = AttentionBackend("flex", FlexImpl, FlexMetadataBuilder, cuda_graphs=True, device_positions=True)
