"""KV events over ZMQ in vLLM's wire format: the stream llm-d's precise prefix-cache scorer (and any
consumer of vLLM's `--kv-events-config`) subscribes to.

The same events SubscribeKvEvents streams (one source: the core's key changes, mirrored by the
front end's hub, engine/kv_event_hub.py); this is a second way out of them. It runs in the front
end beside the hub, not in the core as vLLM's does: the hub is where a gateway's prompt is mapped onto
ours and removals reach every block resting on an evicted key, so both ways out publish the very
same batches, and the core keeps no socket and does no encoding between steps.

Wire format (vLLM 0.34.0, `vllm/distributed/kv_events.py`): each batch is one 3-frame message
`(topic, sequence as 8 bytes big-endian, payload)` on a PUB socket, the sequence counting from 0 per
publisher; the payload is msgpack `[ts, [event, ...], data_parallel_rank]`, each event a map tagged
`"type"`, fields in vLLM's order, fields at their default left out:

    BlockStored      block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
                     lora_name, extra_keys, group_idx, kv_cache_spec_kind
    BlockRemoved     block_hashes, medium, group_idx
    AllBlocksCleared (no field)

One block per BlockStored (its parent places it), as SubscribeKvEvents sends them. Block hashes are
the 64-bit ids SubscribeKvEvents carries, as unsigned ints (vLLM's int form); `medium` is "GPU" (the
engine's own KV cache, on whatever device it runs); `extra_keys` holds one entry per block: None for
text, else `(content hash hex, offset)` of each image/frame overlapping the block, which is what lets a
router's own re-hash tell two videos with the same placeholder tokens apart. Only the first
full-attention pool publishes (group 0, `full_attention`).

The publisher's first batch is its snapshot of the cache (`AllBlocksCleared`, then every block),
and it takes a fresh one (subscribing to the hub again) once `buffer_steps // 2` batches followed
the last, so the last `buffer_steps` batches always hold a snapshot, and once `snapshot_interval_s`
passed without one (--kv-events-snapshot-interval-s), so that a subscriber that joined since and
does not replay (an EPP restarted with its replay port off) learns an idle or quiet pod within that
long, where by batches alone it would wait for traffic. A busy engine, whose batches bring a
snapshot sooner, never runs the timer out: it costs one timer per snapshot, nothing per batch. A
repeated snapshot is idempotent for llm-d: its `AllBlocksCleared` drops the pod from llm-d's index,
and the counts its dedup filter keeps of each block's stores, before the blocks come again.

A subscriber that joins later asks the replay socket (ROUTER, `replay_endpoint`) for the batches
from a sequence on: it answers `(topic, sequence, payload)` per kept batch, then `(b"", -1, b"")`,
from the last `buffer_steps` batches, of which at most two snapshots (a third drops the oldest and
every batch up to it: a timer's snapshots would otherwise fill the buffer with copies of the
cache); replaying from their last `AllBlocksCleared` gives the whole cache, hot prefixes stored
long ago included (a hit publishes nothing, so without the snapshot a block stored before the
window would never be seen again). Memory is bounded: ZMQ queues at most `hwm` messages per
subscriber and drops the rest for that subscriber alone (it sees the gap in the sequence and
replays); the publisher's own queue holds `max_queue_size` batches, and past that it drops what it
holds, counts the drop (`mmserve_kv_events_dropped_total`) and restarts from a fresh snapshot. An
unchanged cache's snapshot goes out again as the same bytes, zero-copy: the replay buffer and the
queue of a subscriber that stopped reading hold references to one payload, not copies.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from itertools import compress, count
from operator import attrgetter, is_not

import msgpack
import zmq

from mmserve.engine.kv_event_hub import Cleared, KvBatch, KvEventsLagError, Removed, Stored
from mmserve.errors import MMServeError

logger = logging.getLogger(__name__)

MEDIUM = "GPU"
FULL_ATTENTION = "full_attention"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_U64 = (1 << 64) - 1
_BLOCK_HASH = attrgetter("block_hash")


@dataclass(frozen=True)
class KvEventsConfig:
    """vLLM's `--kv-events-config` (vllm/config/kv_events.py): the same fields, meanings and defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None   # "zmq" or "null"; unset: "zmq" when enabled
    endpoint: str = "tcp://*:5557"   # bound when it has a wildcard or is ipc/inproc, else connected to
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000   # batches kept for replay
    hwm: int = 100_000           # messages ZMQ queues per subscriber before dropping for it
    max_queue_size: int = 100_000   # batches waiting for the publisher thread
    topic: str = ""   # llm-d reads `kv@<pod>@<model>`

    @classmethod
    def parse(cls, text: str) -> KvEventsConfig:
        """The flag's JSON; ValueError naming what is wrong."""
        if not text.strip():
            return cls()
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-events-config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if unknown := sorted(set(raw) - set(fields)):
            raise ValueError(f"--kv-events-config: unknown field(s) {', '.join(unknown)}; known: {', '.join(fields)}")
        types = {"enable_kv_cache_events": bool, "buffer_steps": int, "hwm": int, "max_queue_size": int}
        for name, value in raw.items():
            want = types.get(name, str)
            optional = name in ("publisher", "replay_endpoint")
            if not (isinstance(value, want) and (want is bool or not isinstance(value, bool))) \
                    and not (optional and value is None):
                raise ValueError(f"--kv-events-config: {name} must be {want.__name__}, got {value!r}")
            if want is int and value < (0 if name == "hwm" else 1):
                raise ValueError(f"--kv-events-config: {name} must be at least {0 if name == 'hwm' else 1}")
        config = cls(**raw)
        if config.publisher not in (None, "zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher must be zmq or null, got {config.publisher!r}")
        return config

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"


def _stored(op: Stored, block_size: int) -> dict:
    return {"type": "BlockStored", "block_hashes": [op.block_hash & _U64],
            "parent_block_hash": None if op.parent is None else op.parent & _U64,
            "token_ids": op.token_ids, "block_size": block_size, "lora_id": None, "medium": MEDIUM,
            "lora_name": None, "extra_keys": [op.extra_keys], "group_idx": 0, "kv_cache_spec_kind": FULL_ATTENTION}


def encode_batch(batch: KvBatch, block_size: int, data_parallel_rank: int = 0) -> bytes:
    """One batch as vLLM's msgpack payload (the module docstring gives the layout)."""
    events = []
    for op in batch.ops:
        if isinstance(op, Stored):
            events.append(_stored(op, block_size))
        elif isinstance(op, Removed):
            events.append({"type": "BlockRemoved", "block_hashes": [h & _U64 for h in op.block_hashes],
                           "medium": MEDIUM, "group_idx": 0})
        elif isinstance(op, Cleared):
            events.append({"type": "AllBlocksCleared"})
    return msgpack.packb([batch.timestamp, events, data_parallel_rank], use_bin_type=True)


class SnapshotEncoder:
    """A snapshot's payload, byte for byte `encode_batch`'s, from each block's event encoded once
    while the hub keeps publishing that block (its mirror hands every snapshot the very same
    `Stored` object for it), and the same payload again for the same snapshot object (an idle
    pod's repeated snapshots: nothing to encode). Per block there is no Python-level work but for
    blocks new since the last snapshot: the look-ups, the identity check and the join run in C."""

    def __init__(self, block_size: int, data_parallel_rank: int = 0):
        self.block_size = block_size
        self._ops: dict[int, Stored] = {}      # block hash -> the op its bytes were encoded from
        self._events: dict[int, bytes] = {}    # block hash -> its BlockStored event, encoded
        self._cleared = msgpack.packb({"type": "AllBlocksCleared"})
        self._rank = msgpack.packb(data_parallel_rank)
        self._batch: KvBatch | None = None
        self._payload = b""

    def encode(self, batch: KvBatch) -> bytes:
        if batch is self._batch:
            return self._payload
        assert batch.snapshot and isinstance(batch.ops[0], Cleared)
        stores = batch.ops[1:]
        hashes = list(map(_BLOCK_HASH, stores))
        if len(self._ops) > 2 * len(hashes):   # mostly blocks gone since: keep only the mirror's
            self._ops = {h: self._ops[h] for h in hashes if h in self._ops}
            self._events = {h: self._events[h] for h in self._ops}
        ops, events = self._ops, self._events
        for op in compress(stores, map(is_not, map(ops.get, hashes), stores)):   # new, or a new op under its hash
            ops[op.block_hash] = op
            events[op.block_hash] = msgpack.packb(_stored(op, self.block_size), use_bin_type=True)
        packer = msgpack.Packer(use_bin_type=True)
        head = packer.pack_array_header(3) + packer.pack(batch.timestamp) + packer.pack_array_header(len(batch.ops))
        self._payload = b"".join((head, self._cleared, *map(events.__getitem__, hashes), self._rank))
        self._batch = batch
        return self._payload


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, ipc or inproc endpoint; connect to any other."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqKvEventPublisher:
    """`start(subscribe)` reads the hub (`subscribe()` is AsyncEngine.subscribe_kv_events) on the event
    loop, which only queues; a thread of its own encodes, sends and answers replays. The sockets are
    opened here, so a port in use fails the server's start. `snapshot_interval_s`: a fresh snapshot
    when none went out for this long (0: by batches only). `on_drop(reason)` counts what it drops."""

    def __init__(self, config: KvEventsConfig, block_size: int, *, snapshot_interval_s: float = 0.0,
                 on_drop: Callable[[str], None] | None = None):
        self.config = config
        self.block_size = block_size
        self.snapshot_interval_s = snapshot_interval_s
        self._on_drop = on_drop
        self._queue: queue.Queue[KvBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._sent: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._snapshots_kept: deque[int] = deque()   # the sequences of the snapshots in _sent
        self._batches_per_snapshot = config.buffer_steps // 2   # after a snapshot: its window always holds one
        self._snapshots = SnapshotEncoder(block_size)   # the thread's alone
        self._topic = config.topic.encode()
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            if _binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))   # a whole replay fits
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._context.destroy(linger=0)
            raise OSError(f"--kv-events-config: cannot open {config.endpoint} / {config.replay_endpoint}: {e}") from e
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or config.endpoint
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None
        self._thread = threading.Thread(target=self._run, name="mmserve-kv-events-zmq", daemon=True)
        self._reader: asyncio.Task | None = None
        self.num_sent = 0   # batches sent (the last one's sequence + 1)

    def start(self, subscribe: Callable[[], AsyncIterator[KvBatch]]) -> None:
        self._thread.start()
        self._reader = asyncio.ensure_future(self._read(subscribe))
        logger.info("publishing KV events on %s (topic %r)%s", self.endpoint, self.config.topic,
                    f", replay on {self.replay_endpoint}" if self.replay_endpoint else "")

    async def _read(self, subscribe: Callable[[], AsyncIterator[KvBatch]]) -> None:
        """The hub's batches into the thread's queue, subscribing again whenever a fresh snapshot is
        due; on overflow, drop it all and start over from a fresh snapshot too (its AllBlocksCleared
        resyncs every subscriber)."""
        while True:
            try:
                async with contextlib.aclosing(subscribe()) as batches:
                    if await self._forward(batches):
                        continue
                return
            except queue.Full:
                reason = "publisher_queue_full"
                logger.warning("the KV event publisher's thread fell %d batches behind: dropped them, resyncing "
                               "from a snapshot", self._drain())
            except KvEventsLagError:   # this loop itself fell behind the hub
                reason = "publisher_lagging"
                logger.warning("the KV event publisher fell behind the engine: resyncing from a snapshot")
            except MMServeError as e:   # the engine's end: nothing more to publish
                logger.info("KV event publisher stops: %s", e)
                return
            if self._on_drop is not None:
                self._on_drop(reason)

    async def _forward(self, batches: AsyncIterator[KvBatch]) -> bool:
        """Queues a subscription's snapshot and the `buffer_steps // 2` batches after it; True when a
        fresh snapshot is due: one more batch arrived (the fresh snapshot holds it, the hub applied
        it first), or `snapshot_interval_s` passed since the snapshot (waiting for a batch is then
        cancelled, which ends the subscription; the fresh one starts from the cache as it is)."""
        after_snapshot = 0
        try:
            async with asyncio.timeout(None) as snapshot_due:
                async for batch in batches:
                    if batch.snapshot:
                        if self.snapshot_interval_s:
                            snapshot_due.reschedule(asyncio.get_running_loop().time() + self.snapshot_interval_s)
                    elif after_snapshot == self._batches_per_snapshot:
                        return True
                    else:
                        after_snapshot += 1
                    self._queue.put_nowait(batch)
        except TimeoutError:
            return True
        return False

    def _drain(self) -> int:
        n = 0
        while True:
            try:
                self._queue.get_nowait()
                n += 1
            except queue.Empty:
                return n

    def _run(self) -> None:
        """The publisher thread: the only user of the sockets once started."""
        sequence = count()
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._answer_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                break
            payload = self._snapshots.encode(batch) if batch.snapshot else encode_batch(batch, self.block_size)
            seq = next(sequence)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)
            self._keep(seq, payload, batch.snapshot)
            self.num_sent = seq + 1
        self._context.destroy(linger=0)
        logger.info("KV event publisher stopped after %d batches", self.num_sent)

    def _keep(self, seq: int, payload: bytes, snapshot: bool) -> None:
        """Into the replay buffer: the last `buffer_steps` batches, of which at most two snapshots: a
        third drops the oldest and every batch up to it. By batches alone no more than two fit (one
        per `buffer_steps // 2 + 1`); a timer's snapshots would fill the buffer with copies."""
        self._sent.append((seq, payload))
        kept = self._snapshots_kept
        if snapshot:
            kept.append(seq)
        while kept and kept[0] < self._sent[0][0]:   # fell out of the buffer
            kept.popleft()
        if len(kept) > 2:
            oldest = kept.popleft()
            while self._sent[0][0] <= oldest:
                self._sent.popleft()

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("a KV event replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._sent):
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload), copy=False)
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._thread.is_alive():
            self._drain()
            self._queue.put(None)
            await asyncio.to_thread(self._thread.join, 5.0)
        else:
            self._context.destroy(linger=0)
