"""FlexAttention over the whole paged cache, compiled once per layer type.

The key sequence is the cache itself (every physical slot); the mask_mod maps a physical slot to
its logical position through per-step tables and applies mask.keep. All per-step data (positions,
ranges, block tables) lives in fixed-capacity tensors that are refilled in place, so new frame
counts or batch compositions never change what dynamo guards on. Query rows are padded to a fixed
token capacity for the same reason. The block mask lists, per 16-row query block, only the
physical blocks some row can keep (its window plus its frame), so fully masked blocks are skipped.

On CUDA this is the batched path for layer types FA4 cannot run (Gemma 4's head-dim-512 full
layers; attention/selection.py): it reads K/V in place, and every tensor it reads (padded query,
block mask, tables) is a persistent buffer refilled each step, so decode steps can be CUDA graphs.
Triton's kernel tile must divide the block mask's blocks, so it runs 16x16 tiles (one query block
by one 16-token page); with head dim 512 that is 16 KiB of K and of V per pipeline stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from mmserve.attention.backend import (
    AttentionBackend,
    CommonAttentionMetadata,
    LayerAttentionSpec,
    PoolConfig,
)
from mmserve.attention.mask import keep, token_request_ids
from mmserve.attention.paged import write_kv
from mmserve.attention.tiles import row_key_bounds

Q_BLOCK = 16
KV_TILE = 16        # Triton's key tile on CUDA: must divide the cache block size
MIN_BLOCKS_PER_REQ = 64
NO_WINDOW = 2**30
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


def make_mask_mod(t: StepTables, block_size: int):
    """mask.keep on physical cache slots; reads per-step data only from `t`'s tensors.

    The range term is always on: layers without bidirectional attention get (-1, -1) rows, so one
    graph serves every window, clamp and bidirectional setting of a head dim and dtype.
    """

    def paged_keep(b, h, q_idx, kv_idx):
        phys = kv_idx // block_size
        lb = t.logical_block[phys]
        req = t.q_req[q_idx]
        k = lb * block_size + kv_idx % block_size
        owned = (lb >= 0) & (t.block_table[req, lb.clamp(min=0)] == phys) & (k < t.seq_lens[req])
        return owned & keep(t.q_pos[q_idx], k, t.r_start[q_idx], t.r_end[q_idx],
                            window=t.window, bidirectional=True, clamp=t.clamp)

    return paged_keep


@dataclass
class FlexMetadata:
    common: CommonAttentionMetadata
    block_mask: BlockMask         # over the builder's persistent block lists
    q_pad: torch.Tensor           # [1, H, padded rows, D]: every call's query, padded (fixed, so flex compiles once)


def cuda_kernel_options(head_dim: int) -> dict:
    """Triton tiles of one query block by KV_TILE keys; two pipeline stages keep head dim 512 in shared memory."""
    options = {"BLOCK_M": Q_BLOCK, "BLOCK_N": KV_TILE, "FORCE_USE_FLEX_ATTENTION": True}
    if head_dim > 256:
        options["num_stages"] = 2
    return options


class FlexMetadataBuilder:
    """Refills the fixed-capacity tables and builds the step's block mask, once per step per layer type."""

    def __init__(self, pool: PoolConfig) -> None:
        self.spec = pool.spec
        self.block_size = pool.block_size
        self.num_padded_tokens = _pow2_at_least(pool.max_num_tokens, Q_BLOCK)
        self.tables = StepTables.allocate(pool.spec, self.num_padded_tokens, pool.max_num_reqs,
                                          _pow2_at_least(pool.max_blocks_per_req, MIN_BLOCKS_PER_REQ),
                                          pool.num_blocks, pool.device)
        self.mask_mod = make_mask_mod(self.tables, pool.block_size)
        if pool.device.type == "cuda" and pool.block_size % KV_TILE:
            raise ValueError(f"flex on CUDA needs a block size that is a multiple of {KV_TILE} (got {pool.block_size})")
        spec, rows = pool.spec, self.num_padded_tokens // Q_BLOCK
        self.q_pad = torch.zeros(1, spec.num_heads, self.num_padded_tokens, spec.head_dim, dtype=pool.dtype,
                                 device=pool.device)
        lists = [torch.zeros(shape, dtype=torch.int32, device=pool.device)
                 for shape in ((1, 1, rows), (1, 1, rows, pool.num_blocks)) * 2]
        self.block_mask = BlockMask.from_kv_blocks(*lists, BLOCK_SIZE=(Q_BLOCK, pool.block_size), mask_mod=self.mask_mod,
                                                   seq_lengths=(self.num_padded_tokens, pool.num_blocks * pool.block_size),
                                                   compute_q_blocks=False)

    def build(self, common: CommonAttentionMetadata) -> FlexMetadata:
        t = self.tables
        if (common.num_actual_tokens > t.q_pos.shape[0] or common.num_reqs > t.seq_lens.shape[0]
                or common.block_table.shape[1] > t.block_table.shape[1]):
            raise ValueError(f"flex: a step of {common.num_actual_tokens} tokens, {common.num_reqs} requests and "
                             f"{common.block_table.shape[1]} blocks per request exceeds the builder's capacity")
        self._fill_tables(common)
        self._fill_block_mask(common)
        return FlexMetadata(common, self.block_mask, self.q_pad)

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

    def _fill_block_mask(self, md: CommonAttentionMetadata) -> None:
        """Per query block, the physical blocks some row may keep (its window and its frame), written
        into the block mask's persistent lists.

        Each row keeps exactly the keys [lo, hi] of row_key_bounds (an interval: both the window
        and the row's own range contain q), so a key block inside every row's interval, of the one
        request all rows belong to, is listed as full and the kernel skips the mask_mod there.
        """
        T, bs = md.num_actual_tokens, md.block_size
        cache_blocks = self.tables.logical_block.shape[0]
        device = md.positions.device
        req = token_request_ids(md.query_start_loc, T)
        lo_key, hi_key = row_key_bounds(md, self.spec)
        logical = torch.arange(md.block_table.shape[1], device=device)
        tables = md.block_table[: md.num_reqs].long()
        phys = tables[req]                                                    # [T, MB]
        used = (logical >= (lo_key // bs)[:, None]) & (logical <= (hi_key // bs)[:, None]) & (phys != 0)
        num_q_blocks = self.num_padded_tokens // Q_BLOCK
        q_block = torch.arange(T, device=device) // Q_BLOCK
        needed = _block_matrix(q_block[:, None].expand_as(phys), phys, used, num_q_blocks, cache_blocks)

        def per_q_block(values: torch.Tensor, fill: int, reduce: str) -> torch.Tensor:
            start = torch.full((num_q_blocks,), fill, dtype=torch.long, device=device)
            return start.scatter_reduce(0, q_block, values, reduce)
        big = 2**62
        block_lo, block_hi = per_q_block(lo_key, -1, "amax"), per_q_block(hi_key, big, "amin")
        owner = per_q_block(req, big, "amin")
        single = owner == per_q_block(req, -1, "amax")
        owner_phys = tables[owner.clamp(0, md.num_reqs - 1)]                  # [num_q_blocks, MB]
        full = (single[:, None] & (logical >= ((block_lo + bs - 1) // bs)[:, None])
                & (logical <= ((block_hi + 1) // bs - 1)[:, None]) & (owner_phys != 0))
        rows = torch.arange(num_q_blocks, device=device)[:, None].expand_as(owner_phys)
        full_blocks = _block_matrix(rows, owner_phys, full, num_q_blocks, cache_blocks)
        partial_blocks = needed & ~full_blocks
        mask = self.block_mask
        for (count, indices), blocks in (((mask.kv_num_blocks, mask.kv_indices), partial_blocks),
                                         ((mask.full_kv_num_blocks, mask.full_kv_indices), full_blocks)):
            new_count, new_indices = _lists(blocks)
            count.copy_(new_count)
            indices.copy_(new_indices)


def _block_matrix(rows: torch.Tensor, phys: torch.Tensor, use: torch.Tensor, num_rows: int,
                  cache_blocks: int) -> torch.Tensor:
    """[num_rows, cache_blocks] bool with True at (rows, phys) where `use` (scatter, no sync)."""
    out = torch.zeros(num_rows, cache_blocks + 1, dtype=torch.bool, device=phys.device)
    out[rows, torch.where(use, phys, cache_blocks)] = True
    return out[:, :cache_blocks]


def _lists(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count [1, 1, rows], indices [1, 1, rows, cache_blocks]) with the listed blocks first."""
    count = blocks.sum(-1, dtype=torch.int32)
    indices = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return count[None, None], indices[None, None]


class FlexImpl:
    """AttentionImpl on compiled flex_attention over the whole paged cache."""

    def __init__(self, spec: LayerAttentionSpec) -> None:
        self.spec = spec

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv_cache: torch.Tensor,
                metadata: FlexMetadata) -> torch.Tensor:
        T = metadata.common.num_actual_tokens
        write_kv(kv_cache, k, v, metadata.common)
        D = q.shape[2]
        num_blocks, block_size, Hkv = kv_cache.shape[1], kv_cache.shape[2], kv_cache.shape[3]
        q_pad = metadata.q_pad   # rows past T hold old queries; the block mask lists nothing for them
        q_pad[0, :, :T] = q[:T].transpose(0, 1)
        keys = kv_cache[0].view(num_blocks * block_size, Hkv, D).transpose(0, 1)[None]
        values = kv_cache[1].view(num_blocks * block_size, Hkv, D).transpose(0, 1)[None]
        out = _compiled_flex(q_pad, keys, values, block_mask=metadata.block_mask, scale=self.spec.scale,
                             enable_gqa=True, kernel_options=cuda_kernel_options(D) if q.is_cuda else None)
        return out[0, :, : q.shape[0]].transpose(0, 1)


BACKEND = AttentionBackend("flex", FlexImpl, FlexMetadataBuilder, cuda_graphs=True)
