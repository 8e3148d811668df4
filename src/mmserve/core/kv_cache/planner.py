"""How the KV cache's bytes are split between the layer types' pools (one plan per pool).

Runs once at start-up in the engine-core process; the plans travel to the worker (and to every
tensor-parallel rank), which allocates the caches they describe.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from mmserve.attention.backend import LayerAttentionSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolPlan:
    """How many blocks a pool gets and what one block costs over all of the pool's layers."""

    layer_type: str
    num_blocks: int          # including the null block
    num_layers: int
    bytes_per_block: int
    window: int | None       # blocks wholly older than this many tokens are reclaimed


def sliding_blocks_per_request(window: int, max_chunk: int, block_size: int) -> int:
    """Most blocks a request holds in a windowed pool: the window behind its chunk plus the chunk."""
    return math.ceil((window + max_chunk) / block_size) + 1


def plan_pools(
    kv_layer_types: list[str] | tuple[str, ...],
    attention_specs: dict[str, LayerAttentionSpec],
    *,
    block_size: int,
    dtype_bytes: int,
    num_kv_blocks: int = 0,
    kv_cache_bytes: int = 0,
    max_num_seqs: int = 0,
    max_chunk: int = 0,
) -> dict[str, PoolPlan]:
    """Size the pools. With `num_kv_blocks` every pool gets that many. Otherwise `kv_cache_bytes`
    buys the same number of blocks in every pool, except that a windowed pool never gets more than
    `max_num_seqs` requests can hold at once (given `max_chunk` tokens per step): the bytes it
    does not need go to the unwindowed pools, which are the ones long videos fill. Only layers that
    hold KV are listed in `kv_layer_types` (`ModelSpec.kv_layer_types`): KV-sharing consumers
    get no blocks."""
    counts = {t: kv_layer_types.count(t) for t in attention_specs if t in kv_layer_types}
    per_block = {
        t: 2 * block_size * attention_specs[t].num_kv_heads * attention_specs[t].head_dim * dtype_bytes * n
        for t, n in counts.items()
    }
    blocks = dict.fromkeys(counts, num_kv_blocks)
    if num_kv_blocks <= 0:
        equal = kv_cache_bytes // max(1, sum(per_block.values()))
        blocks = dict.fromkeys(counts, equal)
        windowed = [t for t in counts if attention_specs[t].window is not None]
        full = [t for t in counts if t not in windowed]
        if max_num_seqs > 0 and windowed and full:
            for t in windowed:
                need = max_num_seqs * sliding_blocks_per_request(attention_specs[t].window, max_chunk, block_size) + 1
                blocks[t] = min(equal, need)
            left = kv_cache_bytes - sum(blocks[t] * per_block[t] for t in windowed)
            for t in full:
                blocks[t] = left // sum(per_block[f] for f in full)
    if min(blocks.values(), default=0) < 2:
        raise ValueError(f"KV cache too small: {blocks} blocks per pool (need >= 2; block 0 is reserved)")
    plans = {t: PoolPlan(t, blocks[t], counts[t], per_block[t], attention_specs[t].window) for t in counts}
    logger.info("KV cache: %s", ", ".join(
        f"{t} {p.num_blocks} blocks x {p.num_layers} layers = {p.num_blocks * p.bytes_per_block / 2**20:.1f} MiB"
        for t, p in plans.items()))
    return plans
