"""Random paged steps (varlen, chunked prefill, decode, video frames, shuffled blocks) for tests and benches.

Everything a backend reads is filled the way the engine's metadata builder fills it, so a backend
that passes on these steps sees nothing new in serving.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mmserve.attention.backend import CommonAttentionMetadata, LayerAttentionSpec, PoolConfig


@dataclass
class Req:
    """One request of a step: `context` tokens cached before, `query` scheduled now, frame ranges (absolute, inclusive)."""

    context: int
    query: int
    ranges: list[tuple[int, int]] = field(default_factory=list)

    @property
    def seq_len(self) -> int:
        return self.context + self.query


@dataclass
class Batch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: torch.Tensor
    metadata: CommonAttentionMetadata
    reqs: list[Req]


def frames(start: int, count: int, length: int, gap: int) -> list[tuple[int, int]]:
    """`count` frame ranges of `length` tokens, `gap` text tokens apart, the first at `start`."""
    return [(start + i * (length + gap), start + i * (length + gap) + length - 1) for i in range(count)]


def query_ranges(reqs: list[Req]) -> torch.Tensor | None:
    """The per-token [start, end] table of the contract, or None when no scheduled token is in a range."""
    rows = []
    for r in reqs:
        for p in range(r.context, r.seq_len):
            rows.append(next(((s, e) for s, e in r.ranges if s <= p <= e), (-1, -1)))
    table = torch.tensor(rows, dtype=torch.int32).reshape(-1, 2)
    return table if bool((table[:, 0] >= 0).any()) else None


def make_batch(reqs: list[Req], spec: LayerAttentionSpec, *, dtype: torch.dtype = torch.float32,
               block_size: int = 16, num_blocks: int = 128, gen: torch.Generator | None = None,
               free_outside_window: bool = False, table_width: int | None = None,
               cache_device: str | torch.device = "cpu") -> Batch:
    """A step over a random paged cache: blocks shuffled, garbage in unused blocks and in the null block 0.

    free_outside_window points blocks that no query of this step can keep at the null block, as the
    scheduler does for sliding layers. table_width fixes the block table's width the way the engine
    does (ceil(max_model_len / block_size)); by default it just fits the batch. cache_device: where
    the cache is made and filled (a GPU fills gigabytes in microseconds; the CPU takes seconds).
    """
    gen = gen or torch.Generator().manual_seed(0)
    H, Hkv, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
    blocks_per_req = [-(-r.seq_len // block_size) for r in reqs]
    assert num_blocks > sum(blocks_per_req), "cache too small for the batch"
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_blocks = table_width or max(blocks_per_req) + 2
    block_table = torch.zeros(len(reqs), max_blocks, dtype=torch.int32)
    if torch.device(cache_device).type == "cpu":
        kv_cache = torch.randn(2, num_blocks, block_size, Hkv, D, generator=gen).to(dtype)
    else:
        device_gen = torch.Generator(cache_device).manual_seed(int(torch.randint(2**62, (1,), generator=gen)))
        kv_cache = torch.empty(2, num_blocks, block_size, Hkv, D, dtype=dtype, device=cache_device)
        kv_cache.normal_(generator=device_gen)
    kv_cache[:, 0] = 1e3  # the null block must never be attended
    positions, slots, qsl = [], [], [0]
    for i, r in enumerate(reqs):
        ids = [physical.pop() for _ in range(blocks_per_req[i])]
        block_table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        for p in range(r.context, r.seq_len):
            positions.append(p)
            slots.append(ids[p // block_size] * block_size + p % block_size)
        qsl.append(qsl[-1] + r.query)
        if free_outside_window and spec.window is not None:
            first_q = r.context
            for b in range(len(ids)):
                keys = range(b * block_size, (b + 1) * block_size)
                needed = any(first_q - key < spec.window for key in keys) or (
                    spec.bidirectional and not spec.clamp_bidirectional
                    and any(s <= key <= e for s, e in r.ranges for key in keys if e >= r.context))
                if not needed:
                    block_table[i, b] = 0
    T = qsl[-1]
    q = torch.randn(T, H, D, generator=gen).to(dtype)
    k = torch.randn(T, Hkv, D, generator=gen).to(dtype)
    v = torch.randn(T, Hkv, D, generator=gen).to(dtype)
    seq_lens = torch.tensor([r.seq_len for r in reqs], dtype=torch.int32)
    query_start_loc = torch.tensor(qsl, dtype=torch.int32)
    positions_t = torch.tensor(positions, dtype=torch.int64)
    ranges = query_ranges(reqs)
    metadata = CommonAttentionMetadata(
        num_actual_tokens=T, num_reqs=len(reqs), max_query_len=max(r.query for r in reqs),
        max_seq_len=max(r.seq_len for r in reqs), query_start_loc=query_start_loc, seq_lens=seq_lens,
        positions=positions_t, block_table=block_table, slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_size=block_size, query_ranges=ranges, query_start_loc_cpu=query_start_loc.clone(),
        seq_lens_cpu=seq_lens.clone(), positions_cpu=positions_t.clone(), block_table_cpu=block_table.clone(),
        query_ranges_cpu=None if ranges is None else ranges.clone())
    return Batch(q, k, v, kv_cache, metadata, reqs)


def pool_for(batch: Batch, spec: LayerAttentionSpec, *, max_num_tokens: int | None = None,
             sdpa_batching: str = "auto") -> PoolConfig:
    """A pool sized like the engine's defaults (512 tokens, 64 requests) unless `batch` needs more,
    so compiled backends see the same capacities, hence one graph, across batches."""
    md = batch.metadata
    return PoolConfig(spec, num_blocks=batch.kv_cache.shape[1], block_size=md.block_size,
                      max_num_tokens=max(max_num_tokens or 512, md.num_actual_tokens),
                      max_num_reqs=max(64, md.num_reqs), max_blocks_per_req=max(64, md.block_table.shape[1]),
                      device=batch.q.device, dtype=batch.q.dtype, sdpa_batching=sdpa_batching)


def run_backend(name: str, batch: Batch, spec: LayerAttentionSpec, kv_cache=None, **pool_options):
    """Build backend `name`'s metadata for `batch` and run one layer; returns (output, the cache written)."""
    from mmserve.attention import create_builder, create_impl

    cache = batch.kv_cache.clone() if kv_cache is None else kv_cache
    metadata = create_builder(name, pool_for(batch, spec, **pool_options)).build(batch.metadata)
    return create_impl(name, spec).forward(batch.q, batch.k, batch.v, cache, metadata), cache
