"""Paged KV blocks: one pool per layer type, per-request block tables, sliding-window reclamation,
automatic prefix caching.

Layer types keep separate pools because their pages differ in size (Gemma 4: head_dim 256 on
sliding layers, 512 on full ones). Every layer of a type shares that type's block ids, so a
request's table for a pool serves all of its layers, KV-sharing consumers included (they read their
producer's cache and hold none of their own, so they cost the pool nothing). Block 0 of every pool is the null block:
never handed out, and the table entry of every reclaimed sliding-window block points at it.

Async scheduling with speculation counts a step's drafts and pads as computed when it schedules
the step (`Request.num_output_placeholders`), and the next step runs lower on the device by as
many as that step rejects: a window is kept from the lowest position the next rows can take
(`_lowest_query`), so no key they attend to is released.

Prefix caching: once a step has computed a full block, the block is keyed (`block_hash`) in every
pool that still holds it; blocks are reference-counted, and a block nobody holds stays keyed in
its pool's free list until the pool runs out of empty blocks (`block_pool`). A new request reuses
the longest prefix that every pool can serve (`find_cached_prefix`): full-attention pools need all
of its blocks, a windowed pool only those holding the last `window - 1` keys before the hit's end;
a hit never ends inside an image/frame (its tokens attend to each other both ways) and never
covers the last known token (its logits are needed).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from mmserve.block_hash import block_hashes, mm_extra_keys
from mmserve.core.kv_cache.block_pool import NULL_BLOCK, BlockPool
from mmserve.core.kv_cache.planner import PoolPlan, window_hold_blocks
from mmserve.core.sched.output import BlockUpdate
from mmserve.ipc.kv_cache_events import BlockRemoved, BlockStored, CacheCleared, EventsStarted, KvEvent
from mmserve.request import Request

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefixHit:
    """The K/V of a request's first `num_tokens` tokens (whole blocks) found already computed:
    `blocks[t]` is the start of its table in pool t, NULL_BLOCK where a windowed pool needs nothing."""

    num_tokens: int = 0
    blocks: dict[str, list[int]] = field(default_factory=dict)
    # The block after the hit is being computed by a running request: admitted a little later, the
    # request would reuse it instead of computing the same prefix beside it.
    next_in_flight: bool = False
    # A hit ending inside a block (`share_prefix`): per pool, the block holding its keys there, which
    # `allocate` copies into the request's own block (the request writes its own tokens after them).
    copy_from: dict[str, int] = field(default_factory=dict)


NO_HIT = PrefixHit()


@dataclass
class _Table:
    blocks: list[int]
    num_reclaimed: int = 0   # leading entries already returned to the pool (now NULL_BLOCK)
    num_reported: int = 0    # entries the runner already knows (take_block_updates)
    reclaimed_reported: int = 0


@dataclass
class _Held:
    """One request's blocks: a table per pool, how many of them are keyed, how many came from a hit,
    and the keys of the known blocks it is still to compute ([num_keyed, in_flight_end) of `keys`)."""

    tables: dict[str, _Table]
    num_keyed: int = 0
    num_hit: int = 0
    keys: list[bytes] = field(default_factory=list)
    in_flight_end: int = 0
    # Kept by `_note_change` whenever a table changes, so a decode step's "nothing to do" is two
    # comparisons (`allocate`): the tokens every table already reaches, and the first position at
    # which some windowed table has an entry to release (`_window_crossed`).
    reach: int = 0
    release_at: float = math.inf


class KVCacheManager:
    """Allocates on demand, all pools or none; releases on finish, abort and preemption. The runner
    keeps its own copy of the tables from the changes `take_block_updates` reports."""

    def __init__(self, plans: dict[str, PoolPlan], block_size: int, *, max_model_len: int,
                 enable_prefix_caching: bool = True):
        self.plans = plans
        self._windowed = [(t, p.window) for t, p in plans.items() if p.window is not None]   # per-step checks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.max_blocks_per_req = math.ceil(max_model_len / block_size)
        self.pools = {t: BlockPool(p.num_blocks) for t, p in plans.items()}
        # The pool whose keys are published (ipc/kv_cache_events.py says why only one).
        self.published_pool = next((t for t, p in plans.items() if p.window is None), next(iter(plans)))
        # Events are built only while `events_on` (a router listens); what a snapshot needs to describe a
        # cached block of that pool is kept regardless: its tokens, its parent's key and its images/frames
        # (block_hash.mm_extra_keys), per block id.
        self.events_on = False
        self._events: list[KvEvent] = []
        published = plans[self.published_pool].num_blocks
        self._block_tokens = np.zeros((published, block_size), dtype=np.int32)
        self._block_parent: list[bytes | None] = [None] * published
        self._block_extra: list[tuple[tuple[str, int], ...] | None] = [None] * published
        if enable_prefix_caching:
            self.pools[self.published_pool].on_evict = self._evicted
        self._held: dict[str, _Held] = {}
        self._in_flight: Counter[bytes] = Counter()   # keys running requests will compute, not yet cached
        self.refusals: Counter[str] = Counter()   # allocations refused, by the pool that lacked blocks
        self._copies: dict[str, list[tuple[int, int]]] = {}   # for the runner (take_block_copies)
        self._changed: set[str] = set()   # requests whose tables changed since take_block_updates last reported them

    # -- queries -------------------------------------------------------------------------------------------

    def block_table(self, request_id: str, layer_type: str) -> list[int]:
        held = self._held.get(request_id)
        return held.tables[layer_type].blocks if held else []

    def num_held(self, request_id: str, layer_type: str) -> int:
        """Real (non-null) blocks the request holds in a pool."""
        held = self._held.get(request_id)
        if not held:
            return 0
        t = held.tables[layer_type]
        return len(t.blocks) - t.num_reclaimed

    def usage(self) -> float:
        """Share of usable blocks in use in the fullest pool (the one that limits admission). Cached
        blocks nobody holds are free: they are reused only when nothing else is left."""
        return max(self.usage_by_pool().values(), default=0.0)

    def usage_by_pool(self) -> dict[str, float]:
        """Share of usable blocks in use per pool (layer type), for the per-pool KV metric."""
        return {t: 1 - p.num_free / p.num_usable for t, p in self.pools.items()}

    def cached_usage(self) -> float:
        """Share of usable blocks that are free but still hold a reusable prefix (the pool with the most)."""
        return max((p.num_cached_free / p.num_usable for p in self.pools.values()), default=0.0)

    def max_blocks_needed(self, num_tokens: int, max_chunk: int) -> dict[str, int]:
        """Most blocks one request of `num_tokens` ever needs per pool, given steps of at most
        `max_chunk` tokens (a windowed pool: its window and one chunk; planner.window_hold_blocks).
        Speculation's K is left out: what a verify chunk writes past a plain decode is allocated only
        if the pool has room, else dropped (pads, then drafts) before anyone is preempted
        (`Scheduler._schedule_running`); its drafts stop before the request's last token
        (Speculator.num_drafts, `Scheduler._chunk` for the async loop's), only the pads filling it
        to 1 + K rows pass it; and the window kept for the rows the step in flight may reject
        (`_lowest_query`) reaches back by that step's rows, which its budget bounds as it does a
        chunk. So one request at this bound is served, verifying fewer rows near its end."""
        full = math.ceil(num_tokens / self.block_size)
        return {t: full if plan.window is None else min(full, window_hold_blocks(plan.window, max_chunk, self.block_size))
                for t, plan in self.plans.items()}

    # -- prefix reuse --------------------------------------------------------------------------------------

    def find_cached_prefix(self, request: Request) -> PrefixHit:
        """The longest prefix of a request that holds no blocks whose K/V every pool still has cached.
        Nothing changes until `allocate` takes the hit. A request that needs the logits of every
        prompt token (prompt logprobs) reads nothing from the cache; its blocks are still cached."""
        if (not self.enable_prefix_caching or request.request_id in self._held
                or request.sampling_params.needs_whole_prompt):
            return NO_HIT
        # wanted: the key of every whole block before the last token; keys: narrowed to what the unwindowed pools hold
        # (a request preempted once all of it was computed may already hold a key past the last token)
        before_last = (request.num_tokens - 1) // self.block_size
        keys = wanted = block_hashes(request, self.block_size, before_last)[:before_last]
        found: dict[str, list[int | None]] = {}
        for t, pool in self.pools.items():   # unwindowed pools first: they bound the hit
            if self.plans[t].window is None:
                found[t] = _leading_hits([pool.lookup(k) for k in keys])
                keys = keys[:len(found[t])]
        for t, pool in self.pools.items():
            if self.plans[t].window is not None:
                found[t] = [pool.lookup(k) for k in keys]
        hit = self._usable_prefix(request, found)
        # Past the hit (blocks cached but unusable yet: a frame or a window cut them off), the first
        # block some pool lacks: if a running request is computing it, waiting lengthens the hit.
        j = hit.num_tokens // self.block_size
        while j < len(wanted) and all(pool.lookup(wanted[j]) is not None for pool in self.pools.values()):
            j += 1
        if j < len(wanted) and wanted[j] in self._in_flight:
            return dataclasses.replace(hit, next_in_flight=True)
        return hit

    def share_prefix(self, parent: Request, child: Request) -> PrefixHit:
        """A hit for `child` (a parallel sample: same prompt and media as `parent`, holding no blocks)
        on the parent's K/V of all of its prompt but the last token, whose logits the child computes
        itself: the whole blocks shared by reference, the block holding the rest copied into the
        child's own (`PrefixHit.copy_from`), so no prompt token and no frame is computed twice, with
        or without prefix caching. A hit never ends inside an image/frame (it then ends at its start).
        NO_HIT when the parent no longer holds those keys (it ended, or its window moved past them)."""
        if child.request_id in self._held:
            raise ValueError(f"{child.request_id} already holds blocks")
        held = self._held.get(parent.request_id)
        n = self.sample_shared_tokens(child)
        if held is None or n == 0 or parent.num_computed_tokens < n:
            return NO_HIT
        if parent.token_ids_slice(0, n) != child.token_ids_slice(0, n):
            raise ValueError(f"{child.request_id} does not share {parent.request_id}'s first {n} tokens")
        k, partial = divmod(n, self.block_size)
        blocks, copy_from = {}, {}
        for t, table in held.tables.items():
            first = self._first_kept(t, n) // self.block_size
            needed = table.blocks[first:k + (partial > 0)]
            if len(needed) < k + (partial > 0) - first or NULL_BLOCK in needed:
                return NO_HIT
            blocks[t] = [NULL_BLOCK] * first + table.blocks[first:k]
            if partial:
                copy_from[t] = table.blocks[k]
        return PrefixHit(n, blocks, copy_from=copy_from)

    @staticmethod
    def sample_shared_tokens(request: Request) -> int:
        """Tokens of K/V a parallel sample of `request` (nothing computed yet) takes from its parent
        (`share_prefix`): all but its last token, whose logits it computes itself, or up to the start
        of the image/frame holding that token."""
        return _outside_range(request.mm_ranges_np, request.num_tokens - 1)

    def _usable_prefix(self, request: Request, found: dict[str, list[int | None]]) -> PrefixHit:
        """The longest k such that blocks [0, k) can serve `request`: every unwindowed pool has all
        of them, every windowed pool those its window still reaches from position k * block_size,
        and that position is not inside an image/frame range."""
        bs = self.block_size
        k = min((len(_leading_hits(f)) if self.plans[t].window is None else len(f)) for t, f in found.items())
        runs = {t: _hit_runs(f) for t, f in found.items() if self.plans[t].window is not None}
        while k > 0:
            k = _outside_ranges(request.mm_ranges_np, k, bs)
            if k == 0 or all(runs[t][k - 1] >= k - self._first_kept(t, k * bs) // bs for t in runs):
                break
            k -= 1
        if k == 0:
            return NO_HIT
        blocks = {}
        for t, f in found.items():
            first = self._first_kept(t, k * bs) // bs
            blocks[t] = [NULL_BLOCK] * first + list(f[first:k])
        return PrefixHit(k * bs, blocks)

    def _media_end_window(self, request: Request, layer_type: str) -> range:
        """The blocks of a windowed pool that a hit ending right after the prompt's last image/frame
        (and its closing token) needs: where another question about the same media parts from it."""
        ranges = request.mm_ranges_np
        if not len(ranges):
            return range(0)
        k = _outside_ranges(ranges, (int(ranges[-1, 1]) + 2) // self.block_size, self.block_size)
        return range(self._first_kept(layer_type, k * self.block_size) // self.block_size, k)

    def _first_kept(self, layer_type: str, pos: int) -> int:
        """Oldest key a query at `pos` (not inside a range) attends to in this pool."""
        window = self.plans[layer_type].window
        return 0 if window is None else max(0, pos - window + 1)

    def cache_blocks(self, request: Request) -> None:
        """Key the full blocks the request's computed tokens now cover. Call after the step that
        computed them ran, or (async scheduling) was launched, before any step that could read them
        is planned: one device stream runs steps in order, so a key always names K/V that is there
        when a hit reads it. (A launched chunk whose media failed to encode runs on zero embeddings:
        its request ends at launch, before anything keys it: `EngineCore._end_media_failed`.)"""
        held = self._held.get(request.request_id)
        if not self.enable_prefix_caching or held is None:
            return
        # (async scheduling with speculation counts a step's drafts as computed before they are known)
        full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if full <= held.num_keyed:
            return
        keys = block_hashes(request, self.block_size, full)[:full]   # it may already reach further
        bs = self.block_size
        for j in range(held.num_keyed, len(keys)):
            for t, table in held.tables.items():
                block = table.blocks[j]
                if block != NULL_BLOCK and self.pools[t].cache(block, keys[j]) and t == self.published_pool:
                    tokens = request.token_ids_slice(j * bs, (j + 1) * bs)
                    self._block_tokens[block] = tokens
                    self._block_parent[block] = keys[j - 1] if j else None
                    self._block_extra[block] = extra = mm_extra_keys(request, j, bs) if request.mm_ranges else None
                    if self.events_on:
                        self._events.append(BlockStored(keys[j], keys[j - 1] if j else None, j, tuple(tokens),
                                                        request.request_id, extra))
        self._done_in_flight(held, len(keys))
        held.num_keyed = max(held.num_keyed, len(keys))

    def _done_in_flight(self, held: _Held, upto: int) -> None:
        """The request no longer computes blocks [num_keyed, upto): they are cached, or it ended."""
        for key in held.keys[held.num_keyed:min(upto, held.in_flight_end)]:
            self._in_flight[key] -= 1
            if not self._in_flight[key]:
                del self._in_flight[key]

    def set_events(self, on: bool) -> None:
        """Build key-change events from now on, or stop. Switching on (even when on: a resync) queues
        `EventsStarted` and then every block the published pool caches, parents first."""
        self.events_on = on
        self._events = [EventsStarted(), *self._cached_blocks()] if on else []

    def _cached_blocks(self) -> list[BlockStored]:
        """The published pool's keyed blocks as stores, each after its parent; a block whose parent was
        evicted is unreachable (hits start at block 0), so it is left out with its descendants."""
        children: dict[bytes | None, list[tuple[bytes, int]]] = {}
        for key, block in self.pools[self.published_pool].keyed():
            children.setdefault(self._block_parent[block], []).append((key, block))
        out: list[BlockStored] = []
        stack = [(key, block, 0) for key, block in reversed(children.get(None, ()))]
        while stack:   # depth first, no recursion: a long video's chain is thousands of blocks
            key, block, index = stack.pop()
            out.append(BlockStored(key, self._block_parent[block], index, tuple(self._block_tokens[block].tolist()), "",
                                   self._block_extra[block]))
            stack.extend((k, b, index + 1) for k, b in reversed(children.get(key, ())))
        return out

    def _evicted(self, key: bytes) -> None:
        if self.events_on:
            self._events.append(BlockRemoved(key))

    def take_events(self) -> list[KvEvent]:
        """The published pool's key changes since the last call, in the order they happened."""
        events, self._events = self._events, []
        return events

    def flush(self) -> bool:
        """Drop every cached prefix; refused (False) while any request holds blocks, as in vLLM:
        its blocks would stay keyed under a name nobody could reach any more."""
        if self._held:
            return False
        for pool in self.pools.values():
            pool.drop_cached()
        if self.events_on:
            self._events.append(CacheCleared())
        return True

    # -- allocation ----------------------------------------------------------------------------------------

    @staticmethod
    def _lowest_query(request: Request) -> int:
        """The lowest position the request's next rows can run at: its computed tokens, less the rows
        the step in flight (async scheduling) counted and may still reject: all its placeholders but
        the token it samples (drafts and pads; the device moves the next step back by what it rejects)."""
        return request.num_computed_tokens - max(0, request.num_output_placeholders - 1)

    def _first_needed(self, request: Request, pos: int, window: int | None) -> int:
        """Oldest position a query at or after `pos` can still attend to in this pool."""
        if window is None or pos == 0:
            return 0
        first = max(0, pos - window + 1)
        ranges = request.vision_ranges_np   # an audio segment is causal: a chunk may end inside it
        if len(ranges):
            # A range still open at `pos` keeps its start (un-clamped bidirectional layers need it).
            i = int(np.searchsorted(ranges[:, 0], pos, side="right")) - 1
            if i >= 0 and ranges[i, 0] < pos <= ranges[i, 1]:
                first = min(first, int(ranges[i, 0]))
        return first

    def allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        """Make room for positions up to num_computed_tokens + num_new_tokens (for a request that
        holds no blocks yet: hit.num_tokens + num_new_tokens, taking the hit's blocks); False, and no
        change, if some pool lacks blocks. Sliding blocks that fell out of the window are released first."""
        rid = request.request_id
        held = self._held.get(rid)
        if held is None:
            start = hit.num_tokens
            tables = {t: _Table(list(hit.blocks.get(t, ()))) for t in self.pools}
            for table in tables.values():   # a windowed pool's hit starts with the blocks it needs no more
                table.num_reclaimed = next((i for i, b in enumerate(table.blocks) if b != NULL_BLOCK),
                                           len(table.blocks))
        elif hit.num_tokens:
            raise ValueError(f"{rid} already holds blocks; a prefix hit is only taken at admission")
        else:
            start, tables = request.num_computed_tokens, held.tables
        needed_len = -(-(start + num_new_tokens) // self.block_size)
        if needed_len > self.max_blocks_per_req:
            raise ValueError(f"{rid}: {needed_len} blocks exceed max_model_len")
        if held is not None and start + num_new_tokens <= held.reach and (   # most decode steps (the second
                start < held.release_at or self._lowest_query(request) < held.release_at):   # test seldom runs)
            return True
        lowest = start if held is None else self._lowest_query(request)   # (a new request has nothing in flight)
        reclaim_to: dict[str, int] = {}
        for t, pool in self.pools.items():
            table = tables[t]
            have = len(table.blocks)
            upto = table.num_reclaimed
            window = self.plans[t].window
            if have and self._window_crossed(window, lowest, table):
                upto = max(upto, min(self._first_needed(request, lowest, window) // self.block_size, have))
            missing = needed_len - have
            if missing > 0:
                available = pool.num_free + pool.num_freed_by_release(table.blocks[table.num_reclaimed:upto])
                if held is None:
                    available -= pool.num_taken_by_touch(table.blocks)
                if missing > available:
                    self.refusals[t] += 1
                    return False
            reclaim_to[t] = upto
        if held is None:
            k = start // self.block_size
            self._held[rid] = held = _Held(tables, num_keyed=k, num_hit=k)
            for t, table in tables.items():
                self.pools[t].touch(table.blocks)
            if self.enable_prefix_caching:
                held.keys = block_hashes(request, self.block_size, request.num_tokens // self.block_size)
                held.in_flight_end = len(held.keys)
                self._in_flight.update(held.keys[k:])
        for t, pool in self.pools.items():
            self._reclaim(request, held, t, reclaim_to[t])
            table = tables[t]
            have = len(table.blocks)
            if needed_len > have:
                table.blocks.extend(pool.take(needed_len - have))
        for t, src in hit.copy_from.items():   # the hit's partial block: the runner copies it before the next step
            self._copies.setdefault(t, []).append((src, tables[t].blocks[start // self.block_size]))
        self._note_change(rid, held)
        return True

    def _note_change(self, request_id: str, held: _Held) -> None:
        """After a request's tables may have changed: report them with its next `take_block_updates`,
        and refresh the bounds within which `allocate` changes nothing (`_Held.reach`, `release_at`)."""
        self._changed.add(request_id)
        bs, tables = self.block_size, held.tables
        held.reach = min(len(table.blocks) for table in tables.values()) * bs
        # _window_crossed(window, pos, table) holds from pos = (num_reclaimed + 1) * bs + window - 1 on
        held.release_at = min(((tables[t].num_reclaimed + 1) * bs + window - 1 for t, window in self._windowed),
                              default=math.inf)

    def _window_crossed(self, window: int | None, pos: int, table) -> bool:
        """Whether a windowed table may hold entries to release at position `pos`: the first key it
        keeps (`_first_needed`, at most pos - window + 1) has crossed a block not released yet. A
        decode's `allocate` and the per-step release first compare against `_Held.release_at`, its
        closed form over the request's tables."""
        return window is not None and (pos - window + 1) // self.block_size > table.num_reclaimed

    def take_block_copies(self) -> dict[str, list[tuple[int, int]]]:
        """The (source, destination) block copies per pool that taken hits asked for since the last
        call: the runner makes them before its next forward, before anything writes to either block."""
        copies, self._copies = self._copies, {}
        return copies

    def release_out_of_window(self, requests: Iterable[Request]) -> None:
        """Return the windowed pools' blocks that no query from each request's next position on can
        reach (`_lowest_query`: under async scheduling, below its count by the rows the step in
        flight may reject). The scheduler calls it for every running request before each step, so a request the
        step leaves out holds only its window, never the chunk it computed last (what the planner's
        windowed reservation assumes: planner.window_pool_blocks). One call for the batch: most
        steps release nothing, and the check is one comparison per request (its `_Held.release_at`),
        then one per windowed pool for a request past it."""
        bs = self.block_size
        for request in requests:
            held = self._held.get(request.request_id)
            if held is None or request.num_computed_tokens < held.release_at:   # no windowed table has crossed a block yet
                continue
            pos = self._lowest_query(request)   # (at most num_computed_tokens: checked second, off the usual path)
            if pos < held.release_at:
                continue
            for t, window in self._windowed:   # a full-attention pool releases nothing before the end
                table = held.tables[t]
                if table.blocks and self._window_crossed(window, pos, table):
                    first = self._first_needed(request, pos, window)
                    self._reclaim(request, held, t, min(first // bs, len(table.blocks)))

    def _reclaim(self, request: Request, held: _Held, layer_type: str, upto: int) -> None:
        """Release a windowed table's entries before `upto` (those not released yet) to the pool."""
        table = held.tables[layer_type]
        a = table.num_reclaimed
        if upto <= a:
            return
        if upto > held.num_keyed:
            # Async scheduling: the step in flight computes blocks that leave the window before its
            # update keys them (this runs while the next step is planned). Key them now: any request
            # that could hit them runs in a later step, which the device runs after this one.
            self.cache_blocks(request)
        # Blocks the window left behind: a later prompt seldom ends right after them, so they are
        # evicted first; unless they came from a hit (a shared prefix ends there) or hold the window
        # of a hit ending after the prompt's media (a new question about it).
        pool, hit = self.pools[layer_type], held.num_hit
        keep = self._media_end_window(request, layer_type)
        pool.release(table.blocks[a:min(upto, hit)])
        for j in range(max(a, hit), upto):
            pool.release(table.blocks[j:j + 1], evict_first=j not in keep)
        table.blocks[a:upto] = [NULL_BLOCK] * (upto - a)
        table.num_reclaimed = upto
        self._note_change(request.request_id, held)

    def take_block_updates(self, request_id: str) -> dict[str, BlockUpdate]:
        """The changes to the request's tables since the last call, per pool that changed (a hit's
        blocks arrive with the first update, a windowed pool's leading nulls as reclaimed entries).
        Only a request whose tables changed since the last call is looked at (most decode steps change none)."""
        updates = {}
        if request_id not in self._changed:
            return updates
        self._changed.discard(request_id)
        held = self._held.get(request_id)
        for t, table in (held.tables if held else {}).items():
            if table.num_reported < len(table.blocks) or table.reclaimed_reported < table.num_reclaimed:
                updates[t] = BlockUpdate(table.num_reported, table.blocks[table.num_reported:], table.num_reclaimed)
                table.num_reported, table.reclaimed_reported = len(table.blocks), table.num_reclaimed
        return updates

    def free(self, request_id: str) -> None:
        """Release a request's blocks, tail first: the LRU then evicts a chain's tail before its head."""
        held = self._held.pop(request_id, None)
        self._changed.discard(request_id)
        if held:
            self._done_in_flight(held, held.in_flight_end)
            for t, table in held.tables.items():
                self.pools[t].release(reversed(table.blocks))


def _leading_hits(found: list) -> list:
    """`found` up to its first None."""
    for i, b in enumerate(found):
        if b is None:
            return found[:i]
    return found


def _hit_runs(found: list) -> list[int]:
    """runs[j] = how many consecutive entries ending at j are hits."""
    runs, run = [], 0
    for b in found:
        run = run + 1 if b is not None else 0
        runs.append(run)
    return runs


def _outside_range(ranges: np.ndarray, pos: int) -> int:
    """`pos`, or the start of the range it lies inside (a chunk may start at a range's first token,
    never after it: the range's tokens attend to each other both ways and are encoded together)."""
    i = int(np.searchsorted(ranges[:, 0], pos, side="left")) - 1 if len(ranges) else -1
    return int(ranges[i, 0]) if i >= 0 and ranges[i, 1] >= pos else pos


def _outside_ranges(ranges: np.ndarray, k: int, block_size: int) -> int:
    """The largest k' <= k whose boundary k' * block_size lies inside no range (a range starting
    exactly there is fine: all of it is computed after the boundary)."""
    while k > 0 and len(ranges):
        pos = k * block_size
        i = int(np.searchsorted(ranges[:, 0], pos, side="left")) - 1   # last range starting before pos
        if i < 0 or ranges[i, 1] < pos:
            break
        k = int(ranges[i, 0]) // block_size
    return k
