"""SubscribeKvEvents and FlushCache: our prefix cache as SMG's cache_aware policy consumes it.

A subscription starts with a snapshot (a `KvCacheCleared`, then every cached block, parents first)
numbered with the last batch's sequence (never 0), then one batch per engine step that changed the
cache, numbered on from there. The engine builds events only while someone is subscribed (and
`LINGER_S` after the last one left; engine/kv_event_hub.py). `start_sequence_number` is not honoured (we keep no history): every
subscriber resyncs from the snapshot, which the leading clear makes safe. Each block is its own
`KvBlocksStored` (its `parent_block_hash` places it), from the first full-attention pool, in the
tokens the router itself sends (engine/kv_event_hub.py). A subscriber that leaves more than
--kv-events-buffer blocks of batches unread is ended with RESOURCE_EXHAUSTED (SMG reconnects and
resyncs); the engine's end ends every stream (UNAVAILABLE).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
from smg_grpc_proto.generated import common_pb2

from mmserve.engine.kv_event_hub import Cleared, KvBatch, Removed, Stored
from mmserve.errors import InvalidInputError, MMServeError
from mmserve.server.status import abort_with

logger = logging.getLogger(__name__)

FULL_ATTENTION = "full_attention"
MAX_FLUSH_WAIT_S = 600


def batch_message(batch: KvBatch, block_size: int, next_event_id) -> common_pb2.KvEventBatch:
    events = []
    for op in batch.ops:
        event = common_pb2.KvCacheEvent(event_id=next_event_id())
        if isinstance(op, Stored):
            stored = event.stored
            stored.blocks.add(block_hash=op.block_hash, token_ids=op.token_ids, block_size=block_size)
            if op.parent is not None:
                stored.parent_block_hash = op.parent
            stored.tier = common_pb2.KV_CACHE_TIER_DEVICE
            stored.locality = common_pb2.KV_CACHE_LOCALITY_LOCAL
            stored.group_idx = 0
            stored.kv_cache_spec_kind = FULL_ATTENTION
        elif isinstance(op, Removed):
            event.removed.block_hashes.extend(op.block_hashes)
            event.removed.tier = common_pb2.KV_CACHE_TIER_DEVICE
            event.removed.locality = common_pb2.KV_CACHE_LOCALITY_LOCAL
            event.removed.group_idx = 0
        elif isinstance(op, Cleared):
            event.cleared.SetInParent()
        events.append(event)
    return common_pb2.KvEventBatch(sequence_number=batch.sequence, timestamp=batch.timestamp, events=events)


async def subscribe(engine, request: common_pb2.SubscribeKvEventsRequest,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.KvEventBatch]:
    """The servicer's SubscribeKvEvents: `async for b in subscribe(...): yield b`."""
    counter = iter(range(1, 2**63))
    block_size = engine.config.block_size
    peer = context.peer()
    logger.info("KV event subscriber %s connected", peer)
    try:
        batches = engine.subscribe_kv_events()
        async for batch in batches:
            yield batch_message(batch, block_size, lambda: next(counter))
    except MMServeError as e:
        logger.warning("KV event subscriber %s dropped: %s", peer, e)
        await abort_with(context, e)
    finally:
        logger.info("KV event subscriber %s gone", peer)


async def flush_cache(engine, request: common_pb2.FlushCacheRequest,
                      context: grpc.aio.ServicerContext) -> common_pb2.FlushCacheResponse:
    """FlushCache: drop every cached prefix once no request is in flight, waiting up to `timeout_s`."""
    timeout = request.timeout_s
    try:
        if not 0 <= timeout <= MAX_FLUSH_WAIT_S:   # NaN included
            raise InvalidInputError("timeout_s", f"{timeout} is not within [0, {MAX_FLUSH_WAIT_S}] seconds")
        flushed = await engine.flush_prefix_cache(timeout_s=timeout)
    except MMServeError as e:
        await abort_with(context, e)
    if flushed:
        return common_pb2.FlushCacheResponse(success=True, message="the prefix cache was flushed")
    return common_pb2.FlushCacheResponse(
        success=False, message=f"requests were still in flight after {timeout:g} s; the prefix cache is flushed "
                               "only while none runs (retry, or pass a timeout_s to wait for the engine to go idle)")
