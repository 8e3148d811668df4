"""How the KV cache's bytes are split between the layer types' pools (one plan per pool).

Runs once at start-up in the engine-core process; the plans travel to the worker (and to every
tensor-parallel rank), which allocates the caches they describe.

A windowed (sliding) pool needs a bounded number of blocks whatever the context: a running request
holds only the keys its next query can reach plus its chunk of the current step, and all requests
together schedule at most one step budget (`window_pool_blocks`). It gets exactly that many for
`max_num_seqs` requests, never more (a block beyond it could never be used; with speculation the
synchronous loop could use K keys a request fewer than the async loop it is sized for); every other byte goes
to the full-attention pools, which hold the long contexts (and, past them, cached prefixes). When the bytes cannot hold those windows
and one request of the full context beside them, fewer requests run at once (`KVCachePlan.max_num_seqs`)
so that no schedule the scheduler admits can run a windowed pool dry; when they cannot hold even one,
the plan is refused, naming what would fit.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from mmserve.attention.backend import LayerAttentionSpec

logger = logging.getLogger(__name__)

GiB = 2**30


@dataclass(frozen=True)
class PoolPlan:
    """How many blocks a pool gets and what one block costs over all of the pool's layers."""

    layer_type: str
    num_blocks: int          # including the null block
    num_layers: int
    bytes_per_block: int
    window: int | None       # blocks wholly older than this many tokens are reclaimed
    # what the runner allocates per block beyond its K/V (attention buffers that grow with the pool:
    # measured by worker/memory_profile.py; 0 when the bytes were given)
    overhead_per_block: int = 0


@dataclass(frozen=True)
class KVCachePlan:
    """The pools, and how many requests may run at once with them (the configured `max_num_seqs`,
    or fewer when the bytes cannot give that many a window beside one full-context request)."""

    pools: dict[str, PoolPlan]
    max_num_seqs: int
    unused_bytes: int = 0    # less than a block of every full-attention pool (all of it without one)

    @property
    def num_bytes(self) -> int:
        """What the pools cost: their K/V and the runner's per-block overhead."""
        return sum(p.num_blocks * (p.bytes_per_block + p.overhead_per_block) for p in self.pools.values())

    def pool_tokens(self, block_size: int) -> dict[str, int]:
        """Tokens of K/V each pool holds (its usable blocks; a windowed pool's are recycled as windows move)."""
        return {t: (p.num_blocks - 1) * block_size for t, p in self.pools.items()}

    def full_context_requests(self, block_size: int, max_model_len: int) -> int:
        """How many requests of `max_model_len` tokens the cache holds at once (windowed pools hold a
        window for each of `max_num_seqs` by construction)."""
        need = math.ceil(max_model_len / block_size)
        full = [(p.num_blocks - 1) // need for p in self.pools.values() if p.window is None]
        return min([self.max_num_seqs, *full])

    def describe(self, block_size: int, max_model_len: int) -> str:
        """One line for the start-up log and `mmserve perf`: each pool's blocks, bytes and tokens."""
        pools = ", ".join(
            f"{t} {p.num_blocks - 1} blocks x {p.num_layers} layers = "
            f"{size_text(p.num_blocks * (p.bytes_per_block + p.overhead_per_block))}, "
            f"{(p.num_blocks - 1) * block_size} tokens" for t, p in self.pools.items())
        return (f"KV cache {size_text(self.num_bytes)}: {pools}; "
                f"{self.full_context_requests(block_size, max_model_len)} requests of {max_model_len} tokens fit, "
                f"{self.max_num_seqs} run at once")


def size_text(n: int) -> str:
    """Bytes for people: GiB from 1 GiB up, else MiB."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.2f} MiB"


class KVCacheTooSmall(ValueError):
    """The KV cache cannot hold one request of the full context: start-up is refused."""


def window_hold_blocks(window: int, tokens: int, block_size: int) -> int:
    """Most blocks one request holds in a pool of `window` while its step writes `tokens` keys:
    the window - 1 keys before them plus the tokens, at the worst alignment to block boundaries."""
    return math.ceil((window - 1 + tokens + block_size - 1) / block_size)


def window_pool_blocks(window: int, *, block_size: int, max_num_seqs: int, max_step_tokens: int,
                       num_speculative_tokens: int = 0) -> int:
    """Blocks (the null block included) that `max_num_seqs` running requests can hold at once in a
    windowed pool. When the scheduler allocates, a running request holds at most as many keys as
    [c - K - window + 1, c + max(n, K)): c its computed tokens, n its chunk this step (0 if it has
    none), K (speculation) the rows a verify chunk counted and may reject: at the end, the blocks of
    rejected drafts it keeps; at the start, under async scheduling, the window of a next row that
    many positions lower (KVCacheManager._lowest_query; the synchronous loop holds K fewer, as does
    the async one with no verify chunk in flight, whose end may then reach 2K past c); all the n
    together are at most one step's tokens. At the worst alignment (its first key on a block's last
    slot) that is ceil((A + max(0, n - K)) / block_size) blocks, A = window + 2K + block_size - 2.
    So every request holds its base ceil(A / block_size), and the step's tokens buy more where they
    buy them soonest: a request's first extra block costs `first` = K + the tokens to its next block
    boundary, each later one a block's worth; while `first` is at most a block, as many requests as
    can take a first one, else one request takes them all."""
    bs, k = block_size, num_speculative_tokens
    a = window + 2 * k + bs - 2
    base = math.ceil(a / bs)
    first = base * bs - a + 1 + k
    takers = min(max_num_seqs if first <= bs else 1, max_step_tokens // first)
    extra = takers + (max_step_tokens - takers * first) // bs if takers else 0
    return 1 + max_num_seqs * base + extra


def plan_pools(
    kv_layer_types: list[str] | tuple[str, ...],
    attention_specs: dict[str, LayerAttentionSpec],
    *,
    block_size: int,
    dtype_bytes: int,
    num_kv_blocks: int = 0,
    kv_cache_bytes: int = 0,
    max_num_seqs: int = 0,
    max_step_tokens: int = 0,
    max_model_len: int = 0,
    num_speculative_tokens: int = 0,
    window_cache_share: float = 0.0,
    block_overhead: dict[str, int] | None = None,
) -> KVCachePlan:
    """Size the pools. With `num_kv_blocks` every pool gets that many (tests, debugging). Otherwise
    `kv_cache_bytes` buys each windowed pool what `max_num_seqs` requests can hold at once (given
    `max_step_tokens` per step and `num_speculative_tokens` drafts) and the full-attention pools the
    rest, the same number of blocks each (every request needs as many in each; what running requests
    do not hold keeps cached prefixes), except `window_cache_share` of what is left beyond one
    full-context request: the windowed pools keep the windows of cached prefixes with it (a prefix
    hit needs the window before its end; prefix caching off: 0). Only layers that hold KV are listed in
    `kv_layer_types` (`ModelSpec.kv_layer_types`): KV-sharing consumers get no blocks.
    `block_overhead`: per pool, what the runner allocates per block beyond its K/V; a block then
    costs both (the bytes are the pools' memory, not the K/V alone)."""
    counts = {t: kv_layer_types.count(t) for t in attention_specs if t in kv_layer_types}
    kv_bytes = {
        t: 2 * block_size * attention_specs[t].num_kv_heads * attention_specs[t].head_dim * dtype_bytes * n
        for t, n in counts.items()
    }
    overhead = {t: (block_overhead or {}).get(t, 0) for t in counts}
    per_block = {t: kv_bytes[t] + overhead[t] for t in counts}

    def plan(blocks: dict[str, int], seats: int, unused: int = 0) -> KVCachePlan:
        if min(blocks.values(), default=0) < 2:
            raise KVCacheTooSmall(f"KV cache too small: {blocks} blocks per pool (need >= 2; block 0 is reserved)")
        return KVCachePlan({t: PoolPlan(t, blocks[t], counts[t], kv_bytes[t], attention_specs[t].window, overhead[t])
                            for t in counts}, seats, unused)

    if num_kv_blocks > 0:
        return plan(dict.fromkeys(counts, num_kv_blocks), max_num_seqs)
    if min(max_num_seqs, max_step_tokens, max_model_len) <= 0:
        raise ValueError("sizing pools from bytes needs max_num_seqs, max_step_tokens and max_model_len")
    windowed = [t for t in counts if attention_specs[t].window is not None]
    full = [t for t in counts if t not in windowed]
    full_cost = sum(per_block[t] for t in full)   # one block in every full-attention pool
    context_blocks = math.ceil(max_model_len / block_size)

    def window_blocks(seats: int) -> dict[str, int]:
        return {t: window_pool_blocks(attention_specs[t].window, block_size=block_size, max_num_seqs=seats,
                                      max_step_tokens=max_step_tokens, num_speculative_tokens=num_speculative_tokens)
                for t in windowed}

    def window_bytes(seats: int) -> int:
        return sum(n * per_block[t] for t, n in window_blocks(seats).items())

    def fits(seats: int) -> bool:   # windows for `seats` requests and one request of the full context
        return window_bytes(seats) + (1 + context_blocks) * full_cost <= kv_cache_bytes

    if not fits(1):
        raise _too_small(kv_cache_bytes, window_bytes(1), full_cost, block_size, max_model_len)
    seats = max_num_seqs
    if not fits(seats):   # the most seats that fit: fits() is monotone in seats
        lo, hi = 1, seats
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        seats = lo
        logger.warning("the KV cache (%s) holds sliding windows for %d requests beside one of the full "
                       "context, not --max-num-seqs %d: at most %d run at once (a lower --max-model-len leaves "
                       "room for more)", size_text(kv_cache_bytes), seats, max_num_seqs, seats)
    blocks, reserved = window_blocks(seats), window_bytes(seats)
    spare = kv_cache_bytes - reserved - (1 + context_blocks) * full_cost   # beyond one full-context request
    cache = int(spare * window_cache_share) if full else (spare if window_cache_share > 0 else 0)
    for t in windowed:   # each windowed pool as many more windows, for cached prefixes
        blocks[t] += cache * blocks[t] // reserved
    left = kv_cache_bytes - sum(blocks[t] * per_block[t] for t in windowed)
    if full:   # beyond what running requests hold, blocks keep cached prefixes
        blocks.update(dict.fromkeys(full, left // full_cost))
    unused = left - sum(blocks[t] * per_block[t] for t in full)
    return plan(blocks, seats, unused)


def _too_small(kv_cache_bytes: int, window_bytes: int, full_cost: int, block_size: int,
               max_model_len: int) -> KVCacheTooSmall:
    """The refusal: what one full-context request needs, and the longest context that would fit."""
    need = window_bytes + (1 + math.ceil(max_model_len / block_size)) * full_cost
    fit_blocks = (kv_cache_bytes - window_bytes) // full_cost - 1 if full_cost else 0
    hint = (f"; lower --max-model-len to at most {fit_blocks * block_size}" if fit_blocks > 0 else
            "; not even one request's sliding window and one step fit: lower --prefill-batched-tokens and "
            "--max-num-batched-tokens")
    return KVCacheTooSmall(
        f"the KV cache ({size_text(kv_cache_bytes)}) cannot hold one request of the full context "
        f"({max_model_len} tokens): it needs {size_text(need)} ({size_text(window_bytes)} of sliding window "
        f"for one request and one step, {size_text(need - window_bytes)} of full-attention blocks); give the "
        f"cache more memory (--gpu-memory-utilization on CUDA, or --kv-cache-bytes){hint}")
