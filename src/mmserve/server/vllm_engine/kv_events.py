"""SubscribeKvEvents and FlushCache: our prefix cache as SMG's cache_aware policy consumes it.

A subscription starts with a snapshot (a `KvCacheCleared`, then every cached block, parents first)
numbered with the last batch's sequence (never 0), then one batch per engine step that changed the
cache, numbered on from there. The engine builds events only while someone is subscribed (and
`LINGER_S` after the last one left; engine/kv_event_hub.py). `start_sequence_number` is not honoured
(we keep no history): every subscriber resyncs from the snapshot, which the leading clear makes safe.
Each block is its own `KvBlocksStored` (its `parent_block_hash` places it), from the first
full-attention pool, in the tokens the router itself sends (engine/kv_event_hub.py), with its
images/frames as multimodal extra keys. A subscriber that leaves more than --kv-events-buffer blocks
of batches unread is ended with RESOURCE_EXHAUSTED (SMG reconnects and resyncs); the engine's end
ends every stream (UNAVAILABLE).

Snapshots cost the event loop nothing a subscriber can repeat: the snapshot's events are synthesized
(event_id 0, as SMG's own relay numbers its snapshots), so one serialization serves every subscriber
that starts from the same cache state; it is built on a worker thread from each block's event,
serialized once while the block stays cached. The stream sends pre-serialized messages (the method is
registered without a serializer: server/vllm_engine/__init__.py). Subscriptions are bounded per
client address and in all (--kv-events-max-subscribers[-per-client]): RESOURCE_EXHAUSTED past them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import operator
from collections import Counter, deque
from collections.abc import AsyncIterator

import grpc
from smg_grpc_proto.generated import common_pb2

from mmserve.engine.kv_event_hub import Cleared, KvBatch, Removed, Stored
from mmserve.errors import InvalidInputError, LimitExceededError, MMServeError
from mmserve.server.status import abort_with

logger = logging.getLogger(__name__)

FULL_ATTENTION = "full_attention"
MAX_FLUSH_WAIT_S = 600
PACING_WINDOW_S = 1.0   # a client's subscriptions start at most max_per_client within this long
_EVENTS_FIELD = 3   # KvEventBatch.events
_BLOCK_HASH = operator.attrgetter("block_hash")


def stored_event(op: Stored, block_size: int, event_id: int = 0) -> common_pb2.KvCacheEvent:
    event = common_pb2.KvCacheEvent(event_id=event_id)
    stored = event.stored
    block = stored.blocks.add(block_hash=op.block_hash, token_ids=op.token_ids, block_size=block_size)
    for identifier, offset in op.extra_keys or ():
        block.extra_keys.add(multimodal=common_pb2.KvMultimodalKey(identifier=identifier, offset=offset))
    if op.parent is not None:
        stored.parent_block_hash = op.parent
    stored.tier = common_pb2.KV_CACHE_TIER_DEVICE
    stored.locality = common_pb2.KV_CACHE_LOCALITY_LOCAL
    stored.group_idx = 0
    stored.kv_cache_spec_kind = FULL_ATTENTION
    return event


def batch_message(batch: KvBatch, block_size: int, next_event_id) -> common_pb2.KvEventBatch:
    events = []
    for op in batch.ops:
        if isinstance(op, Stored):
            events.append(stored_event(op, block_size, next_event_id()))
            continue
        event = common_pb2.KvCacheEvent(event_id=next_event_id())
        if isinstance(op, Removed):
            event.removed.block_hashes.extend(op.block_hashes)
            event.removed.tier = common_pb2.KV_CACHE_TIER_DEVICE
            event.removed.locality = common_pb2.KV_CACHE_LOCALITY_LOCAL
            event.removed.group_idx = 0
        elif isinstance(op, Cleared):
            event.cleared.SetInParent()
        events.append(event)
    return common_pb2.KvEventBatch(sequence_number=batch.sequence, timestamp=batch.timestamp, events=events)


def _field(data: bytes) -> bytes:
    """`data` as one element of KvEventBatch.events on the wire (tag, length, bytes)."""
    n, length = len(data), bytearray()
    while n > 0x7F:
        length.append(n & 0x7F | 0x80)
        n >>= 7
    length.append(n)
    return bytes([_EVENTS_FIELD << 3 | 2]) + bytes(length) + data


class SnapshotSerializer:
    """A snapshot batch's KvEventBatch bytes, built once per snapshot object (the hub hands every
    subscriber the same one until the cache changes), on a worker thread, from each block's event
    serialized once while the block stays cached. A block hash names its whole content (its key
    chains every token and image before it), so the bytes are kept by hash."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._events: dict[int, bytes] = {}   # block hash -> its serialized KvCacheEvent, as a field
        self._cleared = _field(common_pb2.KvCacheEvent(cleared=common_pb2.KvCacheCleared()).SerializeToString())
        self._batch: KvBatch | None = None
        self._bytes: asyncio.Future[bytes] | None = None

    async def serialize(self, batch: KvBatch) -> bytes:
        if batch is not self._batch:
            self._batch = batch
            self._bytes = asyncio.ensure_future(asyncio.to_thread(self._build, batch))
        return await asyncio.shield(self._bytes)

    def _build(self, batch: KvBatch) -> bytes:
        """Per block only a dict look-up and a join: the serializing is for new blocks alone."""
        assert isinstance(batch.ops[0], Cleared) and batch.snapshot
        stores = batch.ops[1:]
        hashes = list(map(_BLOCK_HASH, stores))
        events = self._events
        if len(events) > 2 * len(hashes):   # mostly blocks evicted since: keep only the cached ones
            events = {h: events[h] for h in hashes if h in events}
        for op in stores if not events.keys() >= set(hashes) else ():
            if op.block_hash not in events:
                events[op.block_hash] = _field(stored_event(op, self.block_size).SerializeToString())
        self._events = events
        head = common_pb2.KvEventBatch(sequence_number=batch.sequence, timestamp=batch.timestamp)
        return b"".join((head.SerializeToString(), self._cleared, *map(events.__getitem__, hashes)))


def client_address(peer: str) -> str:
    """The client's address from a gRPC peer string (`ipv4:1.2.3.4:5678`, `ipv6:[::1]:5678`, `unix:...`),
    without its port: what the per-client subscriber limit counts by."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rpartition(":")[0]
    return peer


class KvEventStreams:
    """The two RPCs of one server. Subscriptions are bounded per client address and in all; a
    client's subscriptions start at most `max_per_client` within a second (one past that waits its
    turn, holding its place): a client looping subscribe/cancel gets a few snapshots a second,
    not as many as the server could send."""

    def __init__(self, engine, block_size: int, *, max_subscribers: int, max_per_client: int):
        self.engine = engine
        self.block_size = block_size
        self.max_subscribers = max_subscribers
        self.max_per_client = max_per_client
        self._open: Counter[str] = Counter()             # client address -> its subscriptions open or waiting
        self._starts: dict[str, deque[float]] = {}       # client address -> when its last ones started
        self._snapshots = SnapshotSerializer(block_size)

    @property
    def num_subscribers(self) -> int:
        return sum(self._open.values())

    def _admit(self, client: str) -> None:
        if self.num_subscribers >= self.max_subscribers:
            raise LimitExceededError(f"{self.max_subscribers} KV event subscriptions are open already",
                                     "--kv-events-max-subscribers", retryable=True)
        if self._open[client] >= self.max_per_client:
            raise LimitExceededError(f"this client has {self.max_per_client} KV event subscriptions open already",
                                     "--kv-events-max-subscribers-per-client", retryable=True)
        self._open[client] += 1

    async def _pace(self, client: str) -> None:
        """Wait until fewer than `max_per_client` of the client's subscriptions started within a second."""
        loop = asyncio.get_running_loop()
        starts = self._starts.setdefault(client, deque())
        while len(starts) >= self.max_per_client:
            wait = starts[0] + PACING_WINDOW_S - loop.time()
            if wait <= 0:
                starts.popleft()
            else:
                await asyncio.sleep(wait)
        starts.append(loop.time())

    def _leave(self, client: str) -> None:
        self._open[client] -= 1
        if not self._open[client]:
            del self._open[client]
            starts = self._starts.get(client)
            if starts is not None and starts[-1] + PACING_WINDOW_S <= asyncio.get_running_loop().time():
                del self._starts[client]   # nothing of it is left to pace

    async def subscribe(self, request: common_pb2.SubscribeKvEventsRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """The servicer's SubscribeKvEvents, as serialized KvEventBatch messages."""
        peer = context.peer()
        client = client_address(peer)
        try:
            self._admit(client)
        except MMServeError as e:
            logger.warning("KV event subscriber %s refused: %s", peer, e)
            await abort_with(context, e)
        try:
            await self._pace(client)
            counter = itertools.count(1)
            logger.info("KV event subscriber %s connected", peer)
            async for batch in self.engine.subscribe_kv_events():
                if batch.snapshot:
                    yield await self._snapshots.serialize(batch)
                else:
                    yield batch_message(batch, self.block_size, counter.__next__).SerializeToString()
        except MMServeError as e:
            logger.warning("KV event subscriber %s dropped: %s", peer, e)
            await abort_with(context, e)
        finally:
            self._leave(client)
            logger.info("KV event subscriber %s gone", peer)

    async def flush_cache(self, request: common_pb2.FlushCacheRequest,
                          context: grpc.aio.ServicerContext) -> common_pb2.FlushCacheResponse:
        """FlushCache: drop every cached prefix once no request is in flight, waiting up to `timeout_s`."""
        timeout = request.timeout_s
        try:
            if not 0 <= timeout <= MAX_FLUSH_WAIT_S:   # NaN included
                raise InvalidInputError("timeout_s", f"{timeout} is not within [0, {MAX_FLUSH_WAIT_S}] seconds")
            flushed = await self.engine.flush_prefix_cache(timeout_s=timeout)
        except MMServeError as e:
            await abort_with(context, e)
        if flushed:
            return common_pb2.FlushCacheResponse(success=True, message="the prefix cache was flushed")
        return common_pb2.FlushCacheResponse(
            success=False, message=f"requests were still in flight after {timeout:g} s; the prefix cache is flushed "
                                   "only while none runs (retry, or pass a timeout_s to wait for the engine to go idle)")
