"""The prefix cache as routers see it: a mirror of the published blocks, and its subscribers.

The engine core reports its key changes (ipc/kv_cache_events.py); this hub, in the front end,
turns them into blocks a router can match and streams them to every subscriber, each starting with
a snapshot of what is cached now.

A router matches a request against these blocks by their token ids, block by block from position 0
(SMG's cache_aware: an XXH3 of each block's tokens at its position, chained; our `block_hash` only
places a block after its parent and names it for removal). So a block must carry the tokens the
router itself will send. For a prompt from our own API those are our tokens: a published block is
an engine block (hash = its key's first 8 bytes). A gateway that renders the template itself sends
ONE anchor token per image or video where our prompt holds the expansion (timestamps, frame runs),
so past the first anchor no engine block looks like anything it sends. For such a request
(`EngineRequest.routing_prompt`) the hub publishes the gateway's view instead: block b holds the
gateway's tokens [b*B, (b+1)*B) and is published once every engine block up to the one where its
last token lands is cached; its hash chains on that engine block's key (which names the media by
content), so two videos asked the same question get different hashes but, as the router sees the
same tokens, both replicas match: the router can tell videos apart only by the text around them.
Blocks wholly before the first anchor are the engine's own. The view goes on past the prompt
with what we generate (one for one on both sides), so a follow-up turn that repeats the answer
matches it too. Removing an engine key removes every block resting on it and
their descendants.

Only while someone listens: the core builds no events and the hub mirrors nothing until the first
subscriber arrives; then the core starts its events with a snapshot of its whole cache (in our
tokens: a request's gateway view exists only for requests that arrive while events are on). When
the last subscriber leaves, events go on for `linger_s` (a gateway that was dropped for lagging
reconnects within a fraction of a second, and resyncs from the mirror), then stop and the mirror
is dropped.

A block is published only after its parent (a router places it at its parent's position + 1, so
one whose parent is gone could never be matched from position 0): the mirror's insertion order is
then always parents first, so a snapshot is the mirror's blocks in order, built once per change of
the mirror and shared by every subscriber that starts from it (the gRPC door serializes it once,
off the event loop: server/vllm_engine/kv_events.py).

Memory: one entry per published block (at most a few per cached engine block); a subscriber
buffers at most `max_buffered` blocks of live events and is dropped with `KvEventsLagError` past it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from enum import Enum

from mmserve.block_hash import block_hashes
from mmserve.engine.routing_prompt import RoutingPrompt
from mmserve.engine.types import EngineRequest
from mmserve.errors import LimitExceededError
from mmserve.ipc.kv_cache_events import BlockRemoved, BlockStored, CacheCleared, EventsStarted, KvEvent
from mmserve.request import Request

logger = logging.getLogger(__name__)

LINGER_S = 30.0   # events go on this long after the last subscriber left


class _Recording(Enum):
    OFF = "off"             # no subscriber (past the linger): the core builds nothing, nothing is mirrored
    STARTING = "starting"   # asked the core to start: its events are ignored until EventsStarted
    ON = "on"


class KvEventsLagError(LimitExceededError):
    """A subscriber read too slowly; it must subscribe again (and gets a fresh snapshot)."""

    def __init__(self, max_buffered: int):
        super().__init__(f"this KV event subscriber fell more than {max_buffered} blocks behind; subscribe "
                         "again for a fresh snapshot", "--kv-events-buffer", retryable=True)


def block_id(key: bytes) -> int:
    """A 64-bit signed block hash (the wire's int64) from one of our 32-byte keys."""
    return int.from_bytes(key[:8], "little", signed=True)


@dataclass(frozen=True)
class Stored:
    """`extra_keys`: the block's images/frames as vLLM publishes them (block_hash.mm_extra_keys)."""

    block_hash: int
    parent: int | None
    token_ids: tuple[int, ...]
    extra_keys: tuple[tuple[str, int], ...] | None = None


@dataclass(frozen=True)
class Removed:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class Cleared:
    pass


@dataclass(frozen=True)
class KvBatch:
    """One step's changes (or a snapshot: `Cleared` then every block, parents first)."""

    sequence: int
    timestamp: float
    ops: tuple[Stored | Removed | Cleared, ...]
    snapshot: bool = False


@dataclass
class _Block:
    op: Stored   # how it was published (immutable: snapshots share it)
    children: set[int] = field(default_factory=set)


class _GatewayView:
    """One request's sequence as the gateway sees it (its prompt, then what we generate), mapped onto ours."""

    def __init__(self, request: EngineRequest, routing: RoutingPrompt, block_size: int):
        self.block_size = block_size
        self.tokens = list(routing.token_ids)
        self.published = 0            # gateway blocks already ensured
        self.stored_upto = 0          # engine blocks [0, stored_upto) known to be cached
        self._hashes: list[int] = []
        self.num_engine_own = routing.first_run() // block_size   # leading blocks identical to the engine's
        self._needed = routing.ours_needed()   # our tokens that back the gateway's first j
        r = request
        self._ours = Request(r.request_id, list(r.prompt_token_ids), r.sampling, mm_ranges=list(r.mm_ranges),
                             mm_inputs=list(r.mm_inputs))   # keys as the core computes them, when needed

    def generated(self, token_ids: list[int]) -> None:
        """Generated tokens follow the prompt one for one on both sides."""
        self.tokens.extend(token_ids)
        self._ours.output_token_ids.extend(token_ids)
        for _ in token_ids:
            self._needed.append(self._needed[-1] + 1)

    def ready_blocks(self) -> list[tuple[int, int | None, tuple[int, ...], bytes]]:
        """Gateway blocks newly backed by cached engine blocks: (hash, parent, tokens, resting key).
        They carry no extra keys: a gateway sends one anchor per video and none of its content, so no
        router could fold our frames' hashes into its own (docs/gateway.md#llm-d)."""
        out = []
        bs = self.block_size
        while (self.published + 1) * bs < len(self._needed):
            b = self.published
            end = (self._needed[(b + 1) * bs] - 1) // bs   # the engine block its last token lands in
            if end >= self.stored_upto:
                break
            keys = block_hashes(self._ours, bs, end + 1)
            if end >= len(keys):
                break   # an item without a content hash: the engine keys nothing from there on
            tokens = tuple(self.tokens[b * bs:(b + 1) * bs])
            if b < self.num_engine_own:
                h = block_id(keys[b])
            else:
                h = block_id(hashlib.sha256(b"mmserve-route-v1" + keys[end] + repr(tokens).encode()).digest())
            # Resting on `end` alone suffices, though the block spans engine blocks before it (an anchor's
            # expansion): the published pool is an unwindowed one (KVCacheManager.published_pool; only a
            # checkpoint of sliding layers alone, which no Gemma 4 is, would publish a windowed one), where
            # whoever holds a block holds all its ancestors (hits and forks take a prefix from block 0)
            # and a request releases its blocks tail first (KVCacheManager.free), so the LRU evicts
            # `end` no later than any engine block before it.
            out.append((h, self._hashes[-1] if self._hashes else None, tokens, keys[end]))
            self._hashes.append(h)
            self.published += 1
        return out

    def reset(self) -> None:
        self.published = self.stored_upto = 0
        self._hashes.clear()


class _Subscription:
    def __init__(self, max_buffered: int):
        self.max_buffered = max_buffered
        self._queue: deque[tuple[KvBatch, int]] = deque()   # (batch, blocks it counts against the bound)
        self._buffered = 0
        self._ready = asyncio.Event()
        self.error: BaseException | None = None

    def put(self, batch: KvBatch, *, bounded: bool = True) -> None:
        """`bounded=False`: the snapshot, which the cache's size bounds already, counts for nothing."""
        if self.error is not None:
            return
        size = sum(len(op.block_hashes) if isinstance(op, Removed) else 1 for op in batch.ops) if bounded else 0
        # A subscriber that has read everything always gets the next batch, however large: only one
        # that leaves batches unread past the bound has fallen behind.
        if self._buffered and self._buffered + size > self.max_buffered:
            self.close(KvEventsLagError(self.max_buffered))
            return
        self._queue.append((batch, size))
        self._buffered += size
        self._ready.set()

    def close(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
            self._queue.clear()
            self._buffered = 0
            self._ready.set()

    async def get(self) -> KvBatch:
        while not self._queue:
            if self.error is not None:
                raise self.error
            self._ready.clear()
            await self._ready.wait()
        batch, size = self._queue.popleft()
        self._buffered -= size
        return batch


class KvEventHub:
    """`switch(on)` tells the engine core to build its events or stop (None: no core to tell, as in
    unit tests, which feed `apply` themselves)."""

    def __init__(self, block_size: int, max_buffered: int,
                 switch: Callable[[bool], Awaitable[object]] | None = None, linger_s: float = LINGER_S):
        self.block_size = block_size
        self.max_buffered = max_buffered
        self.linger_s = linger_s
        self.sequence = 0
        self._blocks: dict[int, _Block] = {}       # insertion order: parents first
        self._snapshot: KvBatch | None = None       # of the mirror as it is now, once asked for
        self._resting: dict[bytes, set[int]] = {}   # engine key -> published blocks resting on it
        self._views: dict[str, _GatewayView] = {}   # requests in flight with a gateway's view
        self._subs: set[_Subscription] = set()
        self._closed: BaseException | None = None
        self._switch = switch
        self._recording = _Recording.OFF
        self._core_on = False
        self._started = asyncio.Event()
        self._switching = asyncio.Lock()
        self._linger: asyncio.TimerHandle | None = None
        self._stopping: asyncio.Task | None = None

    @property
    def recording(self) -> bool:
        """Whether events are being built (a subscriber, or one left less than `linger_s` ago)."""
        return self._recording is not _Recording.OFF

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    # -- requests ---------------------------------------------------------------------------------------

    def track(self, request: EngineRequest) -> None:
        """Publish `request`'s blocks in its gateway's view, if it came with one that fits our prompt."""
        routing = request.routing_prompt
        if routing is None or request.fork_of is not None or not self.recording:
            return
        if not routing.maps_onto(request.prompt_token_ids):
            logger.warning("request %s: its routing prompt does not map onto the prompt; publishing ours",
                           request.request_id)
            return
        self._views[request.request_id] = _GatewayView(request, routing, self.block_size)

    def cached(self, request_id: str, num_tokens: int) -> None:
        """The core served the request's first `num_tokens` from the cache (no store event says so)."""
        view = self._views.get(request_id)
        if self._recording is _Recording.ON and view is not None and num_tokens // self.block_size > view.stored_upto:
            view.stored_upto = num_tokens // self.block_size
            ops: list = []
            for h, parent, tokens, key in view.ready_blocks():
                self._add(h, parent, tokens, key, ops)
            self._publish(ops)

    def generated(self, request_id: str, token_ids: list[int]) -> None:
        view = self._views.get(request_id)
        if view is not None:
            view.generated(token_ids)

    def forget(self, request_id: str) -> None:
        """The request ended here; a block the core keys after that (a step already under way) is lost
        to its view, which costs a router at most that block."""
        self._views.pop(request_id, None)

    # -- from the core ----------------------------------------------------------------------------------

    def apply(self, events: list[KvEvent]) -> None:
        if self._recording is _Recording.OFF:
            return   # late events of a core being switched off
        ops: list[Stored | Removed | Cleared] = []
        for event in events:
            if isinstance(event, EventsStarted):
                self._drop_mirror()
                ops.append(Cleared())   # a resync: listeners drop what they hold, the stores follow
                self._recording = _Recording.ON
                self._started.set()
            elif self._recording is not _Recording.ON:
                continue   # from before the core (re)started: the snapshot that follows covers them
            elif isinstance(event, BlockStored):
                self._stored(event, ops)
            elif isinstance(event, BlockRemoved):
                removed: list[int] = []
                for h in self._resting.pop(event.key, ()):
                    self._remove(h, removed)
                if removed:
                    ops.append(Removed(tuple(removed)))
            elif isinstance(event, CacheCleared):
                self._drop_mirror()
                ops.append(Cleared())
        self._publish(ops)

    def _drop_mirror(self) -> None:
        self._blocks.clear()
        self._resting.clear()
        self._snapshot = None
        for view in self._views.values():
            view.reset()

    def _publish(self, ops: list) -> None:
        if ops:
            self.sequence += 1
            batch = KvBatch(self.sequence, time.time(), tuple(ops))
            for sub in list(self._subs):
                sub.put(batch)
                if sub.error is not None:
                    self._subs.discard(sub)

    def _stored(self, event: BlockStored, ops: list) -> None:
        view = self._views.get(event.request_id)
        if view is None:
            parent = block_id(event.parent) if event.parent is not None else None
            self._add(block_id(event.key), parent, event.token_ids, event.key, ops, event.extra_keys)
            return
        view.stored_upto = max(view.stored_upto, event.index + 1)
        for h, parent, tokens, key in view.ready_blocks():
            self._add(h, parent, tokens, key, ops)

    def _add(self, h: int, parent: int | None, tokens: tuple[int, ...], key: bytes, ops: list,
             extra_keys: tuple[tuple[str, int], ...] | None = None) -> None:
        if h in self._blocks or (parent is not None and parent not in self._blocks):
            return   # published already, or unreachable from position 0 (its parent is gone)
        op = Stored(h, parent, tokens, extra_keys)
        self._blocks[h] = _Block(op)
        if parent is not None:
            self._blocks[parent].children.add(h)
        self._resting.setdefault(key, set()).add(h)
        self._snapshot = None
        ops.append(op)

    def _remove(self, h: int, removed: list[int]) -> None:
        block = self._blocks.get(h)
        if block is None:
            return
        self._snapshot = None
        if block.op.parent in self._blocks:
            self._blocks[block.op.parent].children.discard(h)
        stack = [h]   # the block and its descendants (chains are thousands of blocks long: no recursion)
        while stack:
            h = stack.pop()
            block = self._blocks.pop(h, None)
            if block is not None:
                removed.append(h)
                stack.extend(block.children)

    # -- subscribers ------------------------------------------------------------------------------------

    def snapshot(self) -> KvBatch:
        """Everything published now, parents before children (the mirror's order), after a `Cleared`;
        the same object until the mirror changes."""
        if self._snapshot is None:
            ops = (Cleared(), *(block.op for block in self._blocks.values()))
            self._snapshot = KvBatch(self.sequence, time.time(), ops, snapshot=True)
        return self._snapshot

    async def subscribe(self) -> AsyncIterator[KvBatch]:
        """A snapshot of what is cached, then every later batch, until the engine stops (its error) or
        this subscriber leaves more than `max_buffered` blocks of batches unread (KvEventsLagError).
        The first subscriber starts the core's events and gets its snapshot once they run."""
        if self._closed is not None:
            raise self._closed
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        if self._recording is _Recording.OFF:
            self._recording = _Recording.STARTING
            self._started.clear()
            self.sequence += 1   # the snapshot is numbered past every earlier batch: never 0, a heartbeat to SMG
        if self._recording is _Recording.STARTING:
            await self._sync_core()
            await self._started.wait()
            if self._closed is not None:
                raise self._closed
        sub = _Subscription(self.max_buffered)
        sub.put(self.snapshot(), bounded=False)
        self._subs.add(sub)
        try:
            while True:
                yield await sub.get()
        finally:
            self._subs.discard(sub)
            if not self._subs and self._closed is None and self._linger is None:
                self._linger = asyncio.get_running_loop().call_later(self.linger_s, self._stop_recording)

    def _stop_recording(self) -> None:
        """The linger ran out with nobody subscribed: the core stops its events, the mirror goes."""
        self._linger = None
        if self._subs or self._recording is _Recording.OFF:
            return
        self._recording = _Recording.OFF
        self._drop_mirror()
        self._views.clear()
        self._stopping = asyncio.ensure_future(self._sync_core())
        self._stopping.add_done_callback(_log_failure)
        logger.info("no KV event subscriber for %.0f s: the engine stops building KV events", self.linger_s)

    async def _sync_core(self) -> None:
        """Bring the core to what the hub wants now: one switch at a time, so the last word is the
        hub's current state; a hub that is STARTING always asks (a resync), since only the core's
        EventsStarted tells it where the snapshot begins."""
        async with self._switching:
            want = self._recording is not _Recording.OFF
            if self._switch is None:   # no core: whoever feeds `apply` is the source, already running
                if self._recording is _Recording.STARTING:
                    self._recording = _Recording.ON
                    self._started.set()
                return
            if want == self._core_on and self._recording is not _Recording.STARTING:
                return
            await self._switch(want)
            self._core_on = want

    @property
    def num_subscribers(self) -> int:
        return len(self._subs)

    def close(self, error: BaseException) -> None:
        """The engine stopped: every subscription ends with `error`."""
        self._closed = error
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        self._started.set()   # a subscriber waiting for the core's start sees the error
        for sub in self._subs:
            sub.close(error)
        self._subs.clear()


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("could not stop the engine's KV events: %s", task.exception())
