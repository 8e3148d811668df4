"""Paged KV blocks: one pool per layer type, per-request block tables, sliding-window reclamation.

Layer types keep separate pools because their pages differ in size (Gemma 4: head_dim 256 on
sliding layers, 512 on full ones). Every layer of a type shares that type's block ids, so a
request's table for a pool serves all of its layers, KV-sharing consumers included (they read their
producer's cache and hold none of their own, so they cost the pool nothing). Block 0 of every pool is the null block:
never handed out, and the table entry of every reclaimed sliding-window block points at it.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from mmserve.attention.backend import LayerAttentionSpec
from mmserve.scheduler.output import BlockUpdate
from mmserve.scheduler.request import Request

logger = logging.getLogger(__name__)

NULL_BLOCK = 0


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


class BlockPool:
    """Free list of one pool's block ids (1..num_blocks-1)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        return [self._free.popleft() for _ in range(n)]

    def give_back(self, blocks: list[int]) -> None:
        self._free.extend(b for b in blocks if b != NULL_BLOCK)


@dataclass
class _Table:
    blocks: list[int]
    num_reclaimed: int = 0   # leading entries already returned to the pool (now NULL_BLOCK)
    num_reported: int = 0    # entries the runner already knows (take_block_updates)
    reclaimed_reported: int = 0


class KVCacheManager:
    """Allocates on demand, all pools or none; frees on finish, abort and preemption. The runner
    keeps its own copy of the tables from the changes `take_block_updates` reports."""

    def __init__(self, plans: dict[str, PoolPlan], block_size: int, *, max_model_len: int):
        self.plans = plans
        self.block_size = block_size
        self.max_blocks_per_req = math.ceil(max_model_len / block_size)
        self.pools = {t: BlockPool(p.num_blocks) for t, p in plans.items()}
        self._tables: dict[str, dict[str, _Table]] = {}

    # -- queries -------------------------------------------------------------------------------------------

    def block_table(self, request_id: str, layer_type: str) -> list[int]:
        tables = self._tables.get(request_id)
        return tables[layer_type].blocks if tables else []

    def num_held(self, request_id: str, layer_type: str) -> int:
        """Real (non-null) blocks the request holds in a pool."""
        tables = self._tables.get(request_id)
        if not tables:
            return 0
        t = tables[layer_type]
        return len(t.blocks) - t.num_reclaimed

    def usage(self) -> float:
        """Share of usable blocks in use in the fullest pool (the one that limits admission)."""
        return max((1 - p.num_free / p.num_usable for p in self.pools.values()), default=0.0)

    def max_blocks_needed(self, num_tokens: int, max_chunk: int) -> dict[str, int]:
        """Most blocks one request of `num_tokens` ever holds per pool (sliding pools stay bounded)."""
        full = math.ceil(num_tokens / self.block_size)
        out = {}
        for t, plan in self.plans.items():
            if plan.window is None:
                out[t] = full
            else:
                out[t] = min(full, sliding_blocks_per_request(plan.window, max_chunk, self.block_size))
        return out

    # -- allocation ----------------------------------------------------------------------------------------

    def _first_needed(self, request: Request, window: int | None) -> int:
        """Oldest position a query at or after num_computed_tokens can still attend to in this pool."""
        pos = request.num_computed_tokens
        if window is None or pos == 0:
            return 0
        first = max(0, pos - window + 1)
        ranges = request.mm_ranges_np
        if len(ranges):
            # A range still open at `pos` keeps its start (un-clamped bidirectional layers need it).
            i = int(np.searchsorted(ranges[:, 0], pos, side="right")) - 1
            if i >= 0 and ranges[i, 0] < pos <= ranges[i, 1]:
                first = min(first, int(ranges[i, 0]))
        return first

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for positions up to num_computed_tokens + num_new_tokens; False (and no change)
        if some pool lacks blocks. Sliding blocks that fell out of the window are reclaimed first."""
        rid = request.request_id
        needed_len = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        if needed_len > self.max_blocks_per_req:
            raise ValueError(f"{rid}: {needed_len} blocks exceed max_model_len")
        tables = self._tables.get(rid)
        created = tables is None
        if created:
            tables = {t: _Table([]) for t in self.pools}
        reclaim_to: list[int] = []
        for t, pool in self.pools.items():
            table = tables[t]
            have = len(table.blocks)
            window = self.plans[t].window
            upto = table.num_reclaimed
            if window is not None and have:
                upto = max(upto, min(self._first_needed(request, window) // self.block_size, have))
            missing = needed_len - have
            if missing > 0 and missing > pool.num_free + upto - table.num_reclaimed:
                return False
            reclaim_to.append(upto)
        if created:
            self._tables[rid] = tables
        for (t, pool), b in zip(self.pools.items(), reclaim_to, strict=True):
            table = tables[t]
            a = table.num_reclaimed
            if b > a:
                pool.give_back(table.blocks[a:b])
                table.blocks[a:b] = [NULL_BLOCK] * (b - a)
                table.num_reclaimed = b
            have = len(table.blocks)
            if needed_len > have:
                table.blocks.extend(pool.take(needed_len - have))
        return True

    def take_block_updates(self, request_id: str) -> dict[str, BlockUpdate]:
        """The changes to the request's tables since the last call, per pool that changed."""
        updates = {}
        for t, table in self._tables.get(request_id, {}).items():
            if table.num_reported < len(table.blocks) or table.reclaimed_reported < table.num_reclaimed:
                updates[t] = BlockUpdate(table.num_reported, table.blocks[table.num_reported:], table.num_reclaimed)
                table.num_reported, table.reclaimed_reported = len(table.blocks), table.num_reclaimed
        return updates

    def free(self, request_id: str) -> None:
        tables = self._tables.pop(request_id, None)
        if tables:
            for t, table in tables.items():
                self.pools[t].give_back(table.blocks)
