"""KV events over ZMQ (--kv-events-config), checked against the wire format's owners: vLLM's own
event classes and publisher (tests/gateway/vllm_kv_events.py, vendored from the vllm 0.34.0 wheel)
and llm-d's field list and block hashing (llm-d-router's kvevents decoder, llm-d-kv-cache's
docs/indexer.md and token processor: FNV-64a over canonical CBOR of [parent, tokens, extra], chained
from fnv(seed) and the model name; extra = the block's (mm hash, offset) pairs).

- a batch's payload decodes with vLLM's classes to what was published, and vLLM's own encoder
  gives back the very same bytes; a plain msgpack decoder finds llm-d's fields by name;
- our publisher's messages and replay answers are those of vLLM's ZmqEventPublisher for the same
  batches, frame for frame;
- a subscriber that joins after any number of batches (an EPP restarted) replays the whole cache
  from what is kept, a block stored before those batches included;
- a subscriber that never reads leaves the publisher's memory flat;
- a snapshot's payload, built from each block's event encoded once, is the whole batch's encoding
  byte for byte;
- an idle pod sends its whole cache again every snapshot interval to a subscriber that joined late
  (no replay), and llm-d's index takes the repeats as one; the replay buffer keeps two of them;
- a real server under mixed traffic (text, image, video, evictions, a flush): the ZMQ stream,
  decoded with vLLM's classes, reproduces SubscribeKvEvents event by event;
- two real servers, one holding a video and one another video with the same placeholder tokens:
  the router's re-hash of their streams finds the first for a question about its video, and not
  the second (and, without the extra keys, could not tell them apart);
- a router joining an idle real server without replay gets its cache, SubscribeKvEvents' snapshot.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import msgpack
import msgspec
import pytest
import zmq
from gateway_cases import png
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc
from smg_harness import InProcessReplica
from vllm_kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
    ZmqEventPublisher,
)

from mmserve.clients import Client
from mmserve.clients.messages import image_part, message, text_part, video_part
from mmserve.config import DEMO_MODEL_DIR, EngineConfig
from mmserve.engine.input.processor import InputMessage, InputProcessor, TextInput, VideoInput
from mmserve.engine.kv_event_hub import Cleared, KvBatch, KvEventHub, Removed, Stored, block_id
from mmserve.ipc.kv_cache_events import BlockRemoved as BlockRemovedEvent
from mmserve.ipc.kv_cache_events import BlockStored as BlockStoredEvent
from mmserve.model.spec import load_spec_without_transformers
from mmserve.multimodal.synthetic import make_clip
from mmserve.sampling_params import SamplingParams
from mmserve.server.kv_event_publisher import (
    KvEventsConfig,
    SnapshotEncoder,
    ZmqKvEventPublisher,
    encode_batch,
)

BLOCK = 16
U64 = (1 << 64) - 1
VLLM_DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
# llm-d-router's vLLM decoder (pkg/kvevents/engineadapter/vllm_msgpack.go): the fields it reads, by name.
LLMD_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                      "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
LLMD_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def random_batch(rng: random.Random, sequence: int, n: int = 12) -> KvBatch:
    ops: list = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.7:
            extra = tuple((rng.randbytes(32).hex(), rng.randint(-40, 15)) for _ in range(rng.randint(1, 3)))
            ops.append(Stored(rng.randint(-2**63, 2**63 - 1), rng.choice([None, rng.randint(-2**63, 2**63 - 1)]),
                              tuple(rng.randrange(262144) for _ in range(BLOCK)), extra if rng.random() < 0.5 else None))
        elif kind < 0.95:
            ops.append(Removed(tuple(rng.randint(-2**63, 2**63 - 1) for _ in range(rng.randint(1, 4)))))
        else:
            ops.append(Cleared())
    return KvBatch(sequence, rng.uniform(1e9, 2e9), tuple(ops))


def layout(payload: bytes) -> list:
    """A payload as msgpack values with every map as its (key, value) pairs in order: what two encoders
    must agree on (msgspec writes a struct's map header as map16, msgpack-python the shortest form)."""
    return msgpack.unpackb(payload, object_pairs_hook=list)


def assert_vllm_event_is(event, op) -> None:
    """One decoded vLLM event against the op it was published from."""
    if isinstance(op, Stored):
        assert isinstance(event, BlockStored)
        assert event.block_hashes == [op.block_hash & U64] and event.block_size == BLOCK
        assert event.parent_block_hash == (None if op.parent is None else op.parent & U64)
        assert event.token_ids == list(op.token_ids) and event.medium == "GPU"
        assert event.lora_id is None and event.lora_name is None
        (keys,) = event.extra_keys   # one entry per block: None, or its (identifier, offset) pairs
        assert (None if keys is None else tuple(map(tuple, keys))) == op.extra_keys
        assert event.group_idx == 0 and event.kv_cache_spec_kind == "full_attention"
    elif isinstance(op, Removed):
        assert isinstance(event, BlockRemoved)
        assert event.block_hashes == [h & U64 for h in op.block_hashes] and event.group_idx == 0
    else:
        assert isinstance(event, AllBlocksCleared)


def test_payloads_are_vllms_own_encoding_and_carry_llm_ds_fields():
    rng = random.Random(1)
    encoder = msgspec.msgpack.Encoder()
    for seq in range(40):
        batch = random_batch(rng, seq)
        payload = encode_batch(batch, BLOCK)
        decoded = VLLM_DECODER.decode(payload)
        assert decoded.ts == batch.timestamp and decoded.data_parallel_rank == 0
        assert len(decoded.events) == len(batch.ops)
        for event, op in zip(decoded.events, batch.ops, strict=True):
            assert_vllm_event_is(event, op)
        assert layout(encoder.encode(decoded)) == layout(payload), "vLLM's encoder lays the batch out otherwise"
        ts, events, rank = msgpack.unpackb(payload)   # llm-d: [ts, events, rank], events maps tagged "type"
        for event, op in zip(events, batch.ops, strict=True):
            if isinstance(op, Stored):
                assert event["type"] == "BlockStored" and set(event) - {"type"} <= set(LLMD_STORED_FIELDS)
                hashes, tokens = event["block_hashes"], event["token_ids"]
                assert all(0 <= h <= U64 for h in hashes) and len(tokens) == len(hashes) * event["block_size"]
                keys = event["extra_keys"][0]   # llm-d reads each [string, int] pair as (mm hash, offset)
                assert keys is None or all(isinstance(k, str) and isinstance(o, int) for k, o in keys)
            elif isinstance(op, Removed):
                assert event["type"] == "BlockRemoved" and set(event) - {"type"} <= set(LLMD_REMOVED_FIELDS)
            else:
                assert event == {"type": "AllBlocksCleared"}


def _random_store(parent: int | None) -> Stored:
    extra = tuple((random.randbytes(32).hex(), random.randint(-40, 15)) for _ in range(random.randint(1, 3)))
    return Stored(random.randint(-2**63, 2**63 - 1), parent, tuple(random.randrange(262144) for _ in range(BLOCK)),
                  extra if random.random() < 0.3 else None)


def test_a_snapshot_encodes_byte_for_byte_as_the_whole_batch_did():
    """The publisher's snapshots (SnapshotEncoder: each block's event encoded once, joined) against
    `encode_batch` (every event encoded again, the payload as one msgpack object) on a random mirror
    that changes between snapshots: blocks stored on random parents, removed (most of them at once,
    so the encoder drops what it kept for them), a hash back with other content (a new op), and an
    unchanged mirror snapshotted again. The same snapshot object gives the very same payload."""
    encoder = SnapshotEncoder(BLOCK)
    mirror: dict[int, Stored] = {}
    for sequence in range(1, 25):
        kind = random.random()
        if kind < 0.15 and mirror:   # a hash stored again with other content: a new op under it
            h = random.choice(list(mirror))
            mirror[h] = Stored(h, mirror[h].parent, tuple(random.randrange(262144) for _ in range(BLOCK)),
                               mirror[h].extra_keys)
        elif kind < 0.3:   # most blocks evicted at once
            for h in random.sample(list(mirror), k=len(mirror) * 3 // 4):
                del mirror[h]
        elif kind < 0.4:
            pass           # unchanged: a fresh snapshot object of the same blocks
        else:
            for _ in range(random.randint(1, 300)):
                op = _random_store(random.choice([None, *mirror]) if mirror else None)
                mirror[op.block_hash] = op
            for h in random.sample(list(mirror), k=random.randint(0, len(mirror) // 5)):
                del mirror[h]
        snapshot = KvBatch(sequence, random.uniform(1e9, 2e9), (Cleared(), *mirror.values()), snapshot=True)
        payload = encoder.encode(snapshot)
        assert payload == encode_batch(snapshot, BLOCK), f"snapshot {sequence} of {len(mirror)} blocks"
        assert encoder.encode(snapshot) is payload
    empty = KvBatch(25, 1.0, (Cleared(),), snapshot=True)
    assert encoder.encode(empty) == encode_batch(empty, BLOCK)


def test_the_config_is_vllms_and_a_bad_one_is_refused_by_name():
    """vLLM's JSON, its fields and defaults (the vendored KVEventsConfig's); a bad value names itself."""
    theirs = KVEventsConfig(enable_kv_cache_events=True)
    ours = KvEventsConfig.parse('{"enable_kv_cache_events": true}')
    assert ours.enabled and {f: getattr(ours, f) for f in ("endpoint", "replay_endpoint", "buffer_steps", "hwm",
                                                            "max_queue_size", "topic")} == \
        {f: getattr(theirs, f) for f in ("endpoint", "replay_endpoint", "buffer_steps", "hwm", "max_queue_size", "topic")}
    assert not KvEventsConfig.parse("").enabled
    assert not KvEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "null"}').enabled
    for text, named in (("{bad", "not JSON"), ("[1]", "JSON object"), ('{"endpont": "x"}', "endpont"),
                        ('{"hwm": "10"}', "hwm"), ('{"buffer_steps": 0}', "buffer_steps"),
                        ('{"enable_kv_cache_events": 1}', "enable_kv_cache_events"),
                        ('{"publisher": "kafka"}', "kafka")):
        with pytest.raises(ValueError, match=named):
            KvEventsConfig.parse(text)
    serve = subprocess.run([sys.executable, "-m", "mmserve.cli", "serve", "--port", "0", "--kv-events-config",
                            '{"hwm": "10"}'], capture_output=True, text=True, timeout=120)
    assert serve.returncode == 2 and "hwm must be int" in serve.stderr + serve.stdout, serve.stderr[-2000:]


def _ipc(directory: str, name: str) -> str:
    return f"ipc://{directory}/{name}"


def _replay(context: zmq.Context, endpoint: str, start: int) -> list[list[bytes]]:
    """vLLM's replay protocol: a REQ-style request (empty delimiter, 8-byte start), answers to the end marker."""
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart((b"", start.to_bytes(8, "big")))
    frames = []
    while True:
        assert dealer.poll(10_000), "no replay answer"
        message = dealer.recv_multipart()[1:]   # the delimiter off
        if message[1] == (-1).to_bytes(8, "big", signed=True):
            dealer.close(linger=0)
            return frames
        frames.append(message)


def _receive(sub: zmq.Socket, n: int, first: int = 0) -> list[list[bytes]]:
    """The next `n` messages from sequence `first` on, those before it (warm-ups) skipped."""
    out = []
    while len(out) < n:
        assert sub.poll(10_000), "no message"
        message = sub.recv_multipart()
        if int.from_bytes(message[1], "big") >= first:
            out.append(message)
    return out


WARM_UP = KvBatch(0, 1.0, (Cleared(),))


def test_messages_and_replays_are_those_of_vllms_publisher():
    """The same batches through vLLM's ZmqEventPublisher (fed the batches decoded with its classes)
    and through ours: the same (topic, sequence, payload) frames live and in a replay. A SUB hears
    only what is sent once its subscription reached the publisher: both publishers send the same
    warm-up batches, one at a time, until each subscriber has heard one (no sleep to hope it did)."""
    rng = random.Random(2)
    batches = [random_batch(rng, s) for s in range(6)]
    with tempfile.TemporaryDirectory() as d:
        context = zmq.Context()
        subs = {}
        for name in ("ours", "theirs"):
            subs[name] = context.socket(zmq.SUB)
            subs[name].connect(_ipc(d, name))
            subs[name].subscribe(b"")
        theirs = ZmqEventPublisher(0, endpoint=_ipc(d, "theirs"), replay_endpoint=_ipc(d, "theirs-replay"),
                                   topic="kv@pod@m")

        async def main():
            feed: asyncio.Queue[KvBatch] = asyncio.Queue()

            async def hub():
                while True:
                    yield await feed.get()

            def publish(batch: KvBatch) -> None:
                feed.put_nowait(batch)
                theirs.publish(VLLM_DECODER.decode(encode_batch(batch, BLOCK)))

            ours = ZmqKvEventPublisher(KvEventsConfig(enable_kv_cache_events=True, endpoint=_ipc(d, "ours"),
                                                      replay_endpoint=_ipc(d, "ours-replay"), topic="kv@pod@m"), BLOCK)
            ours.start(hub)
            try:
                first, heard = 0, set()
                while len(heard) < len(subs):
                    assert first < 300, f"after {first} warm-up batches only {heard} heard one"
                    publish(WARM_UP)
                    first += 1
                    for name, sub in subs.items():
                        if name not in heard and await asyncio.to_thread(sub.poll, 100):
                            heard.add(name)
                for b in batches:
                    publish(b)
                mine = await asyncio.to_thread(_receive, subs["ours"], len(batches), first)
                vllm = await asyncio.to_thread(_receive, subs["theirs"], len(batches), first)
                replays = [[await asyncio.to_thread(_replay, context, _ipc(d, f"{name}-replay"), start)
                            for name in ("ours", "theirs")] for start in (first + 2, 0)]
            finally:
                await ours.close()
            return first, mine, vllm, replays

        try:
            first, mine, vllm, ((replay_ours, replay_theirs), (whole_ours, whole_theirs)) = asyncio.run(main())
        finally:
            theirs.shutdown()
            context.destroy(linger=0)
    print(f"{first} warm-up batches until both subscribers heard one")
    assert [m[1] for m in mine] == [s.to_bytes(8, "big") for s in range(first, first + len(batches))]
    def frames(messages):
        return [(topic, seq, layout(payload)) for topic, seq, payload in messages]

    assert frames(mine) == frames(vllm)
    assert frames(replay_ours) == frames(replay_theirs) == frames(vllm[2:])
    assert frames(whole_ours) == frames(whole_theirs)   # the warm-ups too, numbered from 0
    assert [w[1] for w in whole_ours] == [s.to_bytes(8, "big") for s in range(first + len(batches))]


def _replayed_cache(frames: list[list[bytes]]) -> dict[int, tuple]:
    """What a router that replays these batches holds: their events applied from the last
    AllBlocksCleared (none: nothing whole to start from), block hash -> (parent, tokens)."""
    events = [e for _, _, payload in frames for e in VLLM_DECODER.decode(payload).events]
    cleared = [i for i, e in enumerate(events) if isinstance(e, AllBlocksCleared)]
    assert cleared, f"no snapshot among the {len(frames)} batches kept for replay"
    cache: dict[int, tuple] = {}
    for e in events[cleared[-1] + 1:]:
        if isinstance(e, BlockStored):
            cache[e.block_hashes[0]] = (e.parent_block_hash, tuple(e.token_ids))
        elif isinstance(e, BlockRemoved):
            for h in e.block_hashes:
                cache.pop(h, None)
    return cache


def test_a_late_subscriber_replays_the_whole_cache_however_long_ago_it_was_stored():
    """An EPP that (re)starts after more than `buffer_steps` batches asks the replay socket for
    everything from sequence 0 and gets the last `buffer_steps`: applied from their last
    AllBlocksCleared they are the hub's whole mirror, the hot prefix stored in the first batch
    included (a hit publishes nothing, so no later batch names it again). A real hub, fed the core's
    events one step at a time (random stores chained on random cached blocks, and evictions), and
    a replay from 0 after every step."""
    buffer_steps = random.randint(1, 6)
    hub = KvEventHub(BLOCK, max_buffered=10_000)

    def tokens():
        return tuple(random.randrange(262144) for _ in range(BLOCK))

    hot = BlockStoredEvent(random.randbytes(32), None, 0, tokens(), "system-prompt")
    keys = {block_id(hot.key): hot.key}

    def next_step() -> list:
        """A store on a cached block (or a new root), or an eviction of one but the hot block."""
        cached = [keys[op.block_hash] for op in hub.snapshot().ops[1:]]
        if len(cached) > 2 and random.random() < 0.3:
            return [BlockRemovedEvent(random.choice(cached[1:]))]
        key = random.randbytes(32)
        keys[block_id(key)] = key
        return [BlockStoredEvent(key, random.choice([None, *cached]), 0, tokens(), "r")]

    def mirror() -> dict[int, tuple]:
        return {op.block_hash & U64: (None if op.parent is None else op.parent & U64, op.token_ids)
                for op in hub.snapshot().ops[1:]}

    num_steps = 3 * buffer_steps + random.randint(1, 4)
    with tempfile.TemporaryDirectory() as d:
        context = zmq.Context()

        async def main():
            publisher = ZmqKvEventPublisher(KvEventsConfig(enable_kv_cache_events=True, endpoint=_ipc(d, "pub"),
                                                           replay_endpoint=_ipc(d, "replay"),
                                                           buffer_steps=buffer_steps), BLOCK)
            publisher.start(hub.subscribe)
            try:
                await asyncio.to_thread(_wait_sent, publisher, 1)   # the first snapshot
                for sent in range(2, num_steps + 2):
                    hub.apply([hot] if sent == 2 else next_step())   # one batch more is sent: this
                    await asyncio.to_thread(_wait_sent, publisher, sent)   # one, or a fresh snapshot holding it
                    frames = await asyncio.to_thread(_replay, context, _ipc(d, "replay"), 0)
                    assert [int.from_bytes(seq, "big") for _, seq, _ in frames] == \
                        list(range(sent))[-buffer_steps:]
                    assert _replayed_cache(frames) == mirror(), f"after {sent} batches"
            finally:
                await publisher.close()

        try:
            asyncio.run(main())
        finally:
            context.destroy(linger=0)
    assert block_id(hot.key) & U64 in mirror()


def test_an_idle_pod_sends_its_snapshot_again_to_a_router_that_joined_late():
    """An EPP (re)started while its pods are idle, its replay port off (llm-d-router v0.10.0 behind our
    overlay): with no traffic at all, a fresh snapshot every `snapshot_interval_s` reaches it, the
    whole cache, byte for byte the same each time (nothing changed), and nothing else. Applied again
    and again it leaves llm-d's index as once (its AllBlocksCleared resets the pod's store counts, so
    an eviction after three of them still evicts). The replay buffer keeps two of them, not one per
    interval. A real hub; the interval short, the waits on the sockets."""
    hub = KvEventHub(BLOCK, max_buffered=10_000)
    keys = [random.randbytes(32) for _ in range(random.randint(2, 40))]
    stores = [BlockStoredEvent(key, random.choice([None, *keys[:i]]), 0,
                               tuple(random.randrange(262144) for _ in range(BLOCK)), "r") for i, key in enumerate(keys)]
    leaf = next(key for key in reversed(keys) if not any(event.parent == key for event in stores))
    with tempfile.TemporaryDirectory() as d:
        context = zmq.Context()
        sub = context.socket(zmq.SUB)

        async def main():
            earlier = hub.subscribe()   # the traffic before: the hub records while someone subscribes
            await earlier.__anext__()
            hub.apply(stores)
            await earlier.aclose()
            publisher = ZmqKvEventPublisher(KvEventsConfig(enable_kv_cache_events=True, endpoint=_ipc(d, "pub"),
                                                           replay_endpoint=_ipc(d, "replay"), topic="kv@pod@m"),
                                            BLOCK, snapshot_interval_s=0.05)
            publisher.start(hub.subscribe)
            try:
                sub.connect(_ipc(d, "pub"))   # after the publisher's first snapshot, or about then
                sub.subscribe(b"")
                received = await asyncio.to_thread(_receive, sub, 3)
                return received, await asyncio.to_thread(_replay, context, _ipc(d, "replay"), 0)
            finally:
                await publisher.close()

        try:
            received, replayed = asyncio.run(main())
        finally:
            context.destroy(linger=0)
    whole = encode_batch(hub.snapshot(), BLOCK)
    assert len(hub.snapshot().ops) == len(keys) + 1
    sequences = [int.from_bytes(seq, "big") for _, seq, _ in received]
    assert sequences == list(range(sequences[0], sequences[0] + 3))
    assert all(payload == whole for _, _, payload in received)
    assert len(replayed) == 2 and all(payload == whole for _, _, payload in replayed)
    assert int.from_bytes(replayed[-1][1], "big") >= sequences[-1]

    index, once = LlmdIndex(BLOCK), LlmdIndex(BLOCK)
    once.apply("kv@pod@m", VLLM_DECODER.decode(whole))
    for topic, _, payload in received:
        index.apply(topic.decode(), VLLM_DECODER.decode(payload))
    assert index.request_key == once.request_key and index.pods == once.pods
    evicted = block_id(leaf) & U64
    index.apply("kv@pod@m", VLLM_DECODER.decode(encode_batch(KvBatch(9, 1.0, (Removed((block_id(leaf),)),)), BLOCK)))
    assert ("pod", evicted) not in index.request_key and "pod" not in index.pods[once.request_key[("pod", evicted)]]
    assert len(index.request_key) == len(keys) - 1


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_a_subscriber_that_never_reads_leaves_the_publishers_memory_flat():
    """100 batches of ~300 KiB to a subscriber that reads nothing (its own buffer one message): past
    the high-water mark ZMQ drops for it, and the replay buffer keeps `buffer_steps`; the process's
    RSS stops growing once those are full (it would grow by the ~46 large batches measured, 14 MiB).
    The hub here, as the real one, starts each subscription with a snapshot (of an empty cache) and
    goes on where the last one stopped: the publisher subscribes again every `buffer_steps // 2`.
    The first subscription's snapshot is sent again until the subscriber holds one (a SUB hears only
    what is sent once its subscription reached the publisher; before it, nothing queues for it)."""
    rng = random.Random(3)
    big = KvBatch(0, 1.0, tuple(Stored(rng.getrandbits(63), None, tuple(rng.randrange(2**17) for _ in range(2048)))
                                for _ in range(40)))
    size = len(encode_batch(big, 2048))
    assert size > 2**18
    with tempfile.TemporaryDirectory() as d:
        context = zmq.Context()
        stalled = context.socket(zmq.SUB)
        stalled.setsockopt(zmq.RCVHWM, 1)
        stalled.setsockopt(zmq.RCVBUF, 4096)
        stalled.connect(_ipc(d, "pub"))
        stalled.subscribe(b"")
        sent, warm_ups = [], []

        async def main():
            publisher = ZmqKvEventPublisher(KvEventsConfig(enable_kv_cache_events=True, endpoint=_ipc(d, "pub"),
                                                           hwm=4, buffer_steps=4), 2048)
            measured = asyncio.Event()
            joined = False
            remaining = iter(range(100))

            async def hub():
                nonlocal joined
                yield KvBatch(0, 1.0, (Cleared(),), snapshot=True)
                while not joined:   # until the subscriber holds one: its subscription reached the publisher
                    joined = await asyncio.to_thread(stalled.poll, 100)   # (holds it: still reads nothing)
                    warm_ups.append(joined)
                    if not joined:
                        yield KvBatch(0, 1.0, (Cleared(),), snapshot=True)
                for i in remaining:
                    if i in (30, 99):
                        await asyncio.to_thread(_wait_sent, publisher, i)
                        sent.append(_rss_bytes())
                    yield big
                measured.set()
                await asyncio.Event().wait()

            publisher.start(hub)
            await measured.wait()
            await publisher.close()

        asyncio.run(main())
        context.destroy(linger=0)
    grown = sent[1] - sent[0]
    print(f"{len(warm_ups)} snapshots until the subscriber held one; RSS grew {grown / 2**20:.1f} MiB")
    assert grown < 6 * 2**20, f"RSS grew {grown / 2**20:.0f} MiB over 69 batches of {size / 2**20:.1f} MiB"


def _wait_sent(publisher: ZmqKvEventPublisher, n: int) -> None:
    """Until the publisher thread took `n` batches (its queue empty) and sent them."""
    deadline = time.monotonic() + 60
    while publisher.num_sent < n:
        assert time.monotonic() < deadline, f"{publisher.num_sent} of {n} sent"
        time.sleep(0.01)


# -- two real servers publishing over ZMQ ------------------------------------------------------------

class ZmqTap:
    """A subscriber as llm-d runs one: SUB on the pod's endpoint, the replay socket for what it missed
    (everything from sequence 0 at the start, any gap later), batches kept by sequence. A replay that
    starts past the sequence asked for (the publisher keeps two snapshots) is taken from its first
    batch on, as llm-d-router does after v0.10.0: the snapshots among them make the whole cache."""

    def __init__(self, endpoint: str, replay_endpoint: str):
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.connect(endpoint)
        self.sub.subscribe(b"kv@")
        self.by_seq: dict[int, tuple[str, bytes]] = {}
        self.first = 0   # the first sequence taken
        self._fill(0)

    def _fill(self, start: int) -> None:
        frames = _replay(self.context, self.replay_endpoint, start)
        for topic, seq, payload in frames:
            self.by_seq[int.from_bytes(seq, "big")] = (topic.decode(), payload)
        if frames and int.from_bytes(frames[0][1], "big") > start:
            self.first = int.from_bytes(frames[0][1], "big")

    def read(self, until, timeout_s: float = 60.0) -> list[tuple[str, KVEventBatch]]:
        """Every batch from the first taken in order (decoded with vLLM's classes), once `until(batches)` holds."""
        deadline = time.monotonic() + timeout_s
        while True:
            while self.sub.poll(0):
                topic, seq, payload = self.sub.recv_multipart()
                self.by_seq[int.from_bytes(seq, "big")] = (topic.decode(), payload)
            taken = sorted(s for s in self.by_seq if s >= self.first)
            if taken and len(taken) <= taken[-1] - self.first:   # a gap: ask for it again
                self._fill(min(set(range(self.first, taken[-1] + 1)) - set(taken)))
                taken = sorted(s for s in self.by_seq if s >= self.first)
            batches = [(t, VLLM_DECODER.decode(p)) for t, p in (self.by_seq[s] for s in taken)]
            if until(batches):
                return batches
            assert time.monotonic() < deadline, "the ZMQ stream did not get there"
            self.sub.poll(200)

    def close(self) -> None:
        self.context.destroy(linger=0)


def _cbor(value) -> bytes:
    """Canonical CBOR (RFC 8949 4.2.1) of what llm-d's block hash encodes: unsigned ints, text, arrays,
    maps with text keys (sorted shortest first, as fxamacker/cbor's canonical mode sorts), null."""
    def head(major: int, n: int) -> bytes:
        if n < 24:
            return bytes([major << 5 | n])
        for extra, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
            if n < 1 << (8 * width):
                return bytes([major << 5 | extra]) + n.to_bytes(width, "big")
        raise ValueError(n)
    if value is None:
        return b"\xf6"
    if isinstance(value, int):
        return head(0, value) if value >= 0 else head(1, -1 - value)
    if isinstance(value, str):
        data = value.encode()
        return head(3, len(data)) + data
    if isinstance(value, list | tuple):
        return head(4, len(value)) + b"".join(_cbor(v) for v in value)
    if isinstance(value, dict):
        items = sorted(((_cbor(k), _cbor(v)) for k, v in value.items()), key=lambda kv: (len(kv[0]), kv[0]))
        return head(5, len(items)) + b"".join(k + v for k, v in items)
    raise TypeError(type(value))


def _fnv64a(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & U64
    return h


class LlmdIndex:
    """llm-d's KV-block index, written from its docs: request keys are FNV-64a of canonical CBOR of
    [parent key, the block's tokens, extra], extra being the block's (mm hash, offset) pairs as
    {"Hash", "Offset"} maps (nil for text), chained from hash(fnv64a(seed), nil, model name). Stores
    are re-hashed from their tokens and extra keys (the parent's request key found by its engine
    hash); a prompt scores, per pod, the blocks from position 0 that pod holds. `use_extra_keys`
    False re-hashes tokens only, as a router that ignores them does. As llm-d-router's event pool
    (pkg/kvevents/pool.go and its dedup filter) does: a store counts, a removal evicts once it
    balanced every store of that hash, and AllBlocksCleared drops the pod and its counts."""

    def __init__(self, block_size: int, *, use_extra_keys: bool = True, seed: str = ""):
        self.block_size = block_size
        self.use_extra_keys = use_extra_keys
        self.seed = _fnv64a(seed.encode())
        self.request_key: dict[tuple[str, int], int] = {}   # (pod, engine hash) -> request key
        self.pods: dict[int, set[str]] = {}
        self.stores: Counter[tuple[str, int]] = Counter()   # (pod, engine hash) -> stores not yet removed

    def _chain(self, parent: int, tokens, extras) -> list[int]:
        keys = []
        for i, extra in enumerate(extras):
            chunk = list(tokens[i * self.block_size:(i + 1) * self.block_size])
            mm = [{"Hash": h, "Offset": o} for h, o in extra] if extra and self.use_extra_keys else None
            parent = _fnv64a(_cbor([parent, chunk, mm]))
            keys.append(parent)
        return keys

    def apply(self, topic: str, batch: KVEventBatch) -> None:
        _, pod, model = topic.split("@")
        for e in batch.events:
            if isinstance(e, BlockStored):
                init = _fnv64a(_cbor([self.seed, None, model]))
                parent = init if e.parent_block_hash is None else self.request_key.get((pod, e.parent_block_hash), init)
                extras = [[(k[0], k[1]) for k in keys] if keys else None for keys in (e.extra_keys or [None] * len(e.block_hashes))]
                for h, key in zip(e.block_hashes, self._chain(parent, e.token_ids, extras), strict=True):
                    self.request_key[(pod, h)] = key
                    self.pods.setdefault(key, set()).add(pod)
                    self.stores[(pod, h)] += 1
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    self.stores[(pod, h)] -= 1
                    if self.stores[(pod, h)] > 0:
                        continue   # stored more often than removed: still held
                    del self.stores[(pod, h)]
                    key = self.request_key.pop((pod, h), None)
                    if key is not None:
                        self.pods[key].discard(pod)
            else:   # AllBlocksCleared: the pod holds nothing
                for (p, h) in [k for k in self.request_key if k[0] == pod]:
                    self.pods[self.request_key.pop((p, h))].discard(pod)
                    self.stores.pop((p, h), None)

    def score(self, tokens, mm_items, model: str) -> dict[str, int]:
        """`mm_items`: (hash, start, length) per image/frame placeholder run of `tokens`."""
        n = len(tokens) // self.block_size
        extras = []
        for b in range(n):   # llm-d's ComputeBlockExtraFeatures
            first, end = b * self.block_size, (b + 1) * self.block_size
            extras.append([(h, s - first) for h, s, length in sorted(mm_items, key=lambda m: m[1])
                           if s + length > first and s < end] or None)
        keys = self._chain(_fnv64a(_cbor([self.seed, None, model])), tokens, extras)
        scores: dict[str, int] = {}
        for pod in set().union(*self.pods.values()) if self.pods else ():
            scores[pod] = next((i for i, k in enumerate(keys) if pod not in self.pods.get(k, ())), len(keys))
        return scores


PODS = ("pod-a", "pod-b")
MODEL = DEMO_MODEL_DIR.name


@pytest.fixture(scope="module")
def fleet():
    """Two replicas publishing on ipc endpoints of a private directory, and a tap on each. pod-a
    snapshots by batches alone (its stream is SubscribeKvEvents' batch for batch), pod-b also every
    half second without one (a router joining it idle)."""
    with tempfile.TemporaryDirectory() as d:
        replicas, taps = [], []
        try:
            for pod, interval in zip(PODS, ("0", "0.5"), strict=True):
                config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": _ipc(d, pod),
                          "replay_endpoint": _ipc(d, f"{pod}-replay"), "topic": f"kv@{pod}@{MODEL}"}
                replicas.append(InProcessReplica("--num-kv-blocks", "64", "--kv-events-config", json.dumps(config),
                                                 "--kv-events-snapshot-interval-s", interval))
            for replica in replicas:
                replica.wait_ready(time.monotonic() + 180)
            taps = [ZmqTap(_ipc(d, pod), _ipc(d, f"{pod}-replay")) for pod in PODS]
            yield replicas, taps
        finally:
            for tap in taps:
                tap.close()
            for replica in replicas:
                replica.stop()


@pytest.fixture(scope="module")
def processor():
    """The servers' own preprocessing, as a router that tokenizes like its engines does (llm-d runs
    vLLM's): a request's prompt ids, placeholder runs and their content hashes."""
    executor = ThreadPoolExecutor(2)
    config = EngineConfig(model=str(DEMO_MODEL_DIR), device="cpu", default_num_frames=4)
    proc = InputProcessor.from_checkpoint(config, executor, spec=load_spec_without_transformers(DEMO_MODEL_DIR), context_length=1024,
                                          workers=1)

    def process(*parts):
        return asyncio.run(proc.process("q", [InputMessage("user", parts)], SamplingParams(max_tokens=2)))
    yield process
    executor.shutdown()


QUESTION = "Look at the clip: which way does the shape move, and is it fast or slow? Answer briefly."


def test_the_routers_rehash_finds_the_replica_that_holds_the_video(fleet, processor):
    replicas, taps = fleet
    clips = [make_clip(21, num_frames=8).data, make_clip(22, num_frames=8).data]
    queries = [processor(TextInput(QUESTION), VideoInput(data=clip, num_frames=4)) for clip in clips]
    assert queries[0].prompt_token_ids == queries[1].prompt_token_ids, "the same placeholder tokens"
    assert queries[0].mm_inputs[0].content_hash != queries[1].mm_inputs[0].content_hash
    for replica, clip, query in zip(replicas, clips, queries, strict=True):
        with Client(replica.address) as c:
            out = c.generate([message("user", text_part(QUESTION), video_part(clip, num_frames=4))],
                             max_tokens=2, temperature=0)
        assert out.usage.prompt_tokens == len(query.prompt_token_ids)

    def items(q):
        return [(m.content_hash.hex(), s, e - s + 1) for (s, e), m in zip(q.mm_ranges, q.mm_inputs, strict=True)]

    whole = len(queries[0].prompt_token_ids) // BLOCK
    before_video = queries[0].mm_ranges[0][0] // BLOCK
    assert 0 < before_video < whole
    index, blind = LlmdIndex(BLOCK), LlmdIndex(BLOCK, use_extra_keys=False)
    for pod, tap, query in zip(PODS, taps, queries, strict=True):
        def holds_it(batches, pod=pod, query=query):
            seen = LlmdIndex(BLOCK)
            for topic, batch in batches:
                seen.apply(topic, batch)
            return seen.score(query.prompt_token_ids, items(query), MODEL).get(pod) == whole
        for topic, batch in tap.read(holds_it):
            index.apply(topic, batch)
            blind.apply(topic, batch)
    for mine, other, query in ((PODS[0], PODS[1], queries[0]), (PODS[1], PODS[0], queries[1])):
        scores = index.score(query.prompt_token_ids, items(query), MODEL)
        assert scores[mine] == whole and scores[other] == before_video, scores
    blind_scores = blind.score(queries[0].prompt_token_ids, items(queries[0]), MODEL)
    assert blind_scores == {PODS[0]: whole, PODS[1]: whole}, "without extra keys the two videos look alike"


def _fold(h: int | None) -> int | None:
    """A published 64-bit hash as the proto's signed int64 (as SMG's relay folds vLLM's)."""
    return None if h is None else h - (1 << 64) if h >= 1 << 63 else h


def assert_same_event(ours: common_pb2.KvCacheEvent, theirs) -> None:
    kind = ours.WhichOneof("data")
    if kind == "stored":
        assert isinstance(theirs, BlockStored)
        (block,) = ours.stored.blocks
        assert [_fold(h) for h in theirs.block_hashes] == [block.block_hash]
        parent = ours.stored.parent_block_hash if ours.stored.HasField("parent_block_hash") else None
        assert _fold(theirs.parent_block_hash) == parent
        assert theirs.token_ids == list(block.token_ids) and theirs.block_size == block.block_size
        (keys,) = theirs.extra_keys
        assert [tuple(k) for k in keys or ()] == [(k.multimodal.identifier, k.multimodal.offset)
                                                  for k in block.extra_keys]
        assert theirs.kv_cache_spec_kind == ours.stored.kv_cache_spec_kind and theirs.group_idx == ours.stored.group_idx
    elif kind == "removed":
        assert isinstance(theirs, BlockRemoved)
        assert [_fold(h) for h in theirs.block_hashes] == list(ours.removed.block_hashes)
    else:
        assert kind == "cleared" and isinstance(theirs, AllBlocksCleared)


class GrpcTap:
    """SubscribeKvEvents read on a thread: `wait(until)` returns the batches once `until(batches)` holds."""

    def __init__(self, stub):
        self.batches: list[common_pb2.KvEventBatch] = []
        self._changed = threading.Condition()
        self._stream = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=300)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for batch in self._stream:
                with self._changed:
                    self.batches.append(batch)
                    self._changed.notify_all()
        except grpc.RpcError:
            pass   # cancelled at the end

    def wait(self, until, timeout_s: float = 60.0) -> list[common_pb2.KvEventBatch]:
        with self._changed:
            assert self._changed.wait_for(lambda: until(self.batches), timeout_s), "SubscribeKvEvents did not get there"
            return list(self.batches)

    def cancel(self) -> None:
        self._stream.cancel()


def _after_flush_and_a_store(batches) -> bool:
    """A clear among the live batches, and a store after it."""
    kinds = [e.WhichOneof("data") for b in batches[1:] for e in b.events]
    return "cleared" in kinds and "stored" in kinds[kinds.index("cleared"):]


def test_the_zmq_stream_reproduces_subscribe_kv_events_event_by_event(fleet):
    """Text, an image, a video, a repeated prompt (a hit), enough more text to evict, a flush and a
    request after it: every batch SubscribeKvEvents streams after its snapshot is a ZMQ batch, in the
    same order, the same events field for field (and the ZMQ state before them is the snapshot)."""
    replicas, taps = fleet
    replica, tap = replicas[0], taps[0]
    with grpc.insecure_channel(replica.address) as channel:
        stub = vpb_grpc.VllmEngineStub(channel)
        subscription = GrpcTap(stub)
        with Client(replica.address) as c:
            def ask(*parts):
                c.generate([message("user", *parts)], max_tokens=3, temperature=0)
            words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()
            texts = [" ".join(random.Random(i).choices(words, k=40)) for i in range(12)]
            ask(text_part(texts[0]))
            ask(image_part(png(4)), text_part("What is in the picture?"))
            ask(text_part("And this clip?"), video_part(make_clip(23, num_frames=8).data, num_frames=4))
            ask(text_part(texts[0]))   # a prefix hit: nothing new stored
            for text in texts[1:]:     # 64 blocks of 16 tokens: these evict
                ask(text_part(text))
        assert stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=30), timeout=60).success
        with Client(replica.address) as c:
            c.generate([message("user", text_part(texts[5]))], max_tokens=3, temperature=0)
        grpc_batches = subscription.wait(_after_flush_and_a_store)
        subscription.cancel()
    snapshot, live = grpc_batches[0], grpc_batches[1:]
    kinds = {e.WhichOneof("data") for b in live for e in b.events}
    assert kinds == {"stored", "removed", "cleared"}, kinds
    assert any(e.stored.blocks[0].extra_keys for b in live for e in b.events if e.WhichOneof("data") == "stored")
    zmq_batches = [b for _, b in tap.read(lambda bs: any(b.ts == live[-1].timestamp for _, b in bs))]
    start = next(i for i, b in enumerate(zmq_batches) if b.ts == live[0].timestamp)
    state: dict[int, tuple] = {}   # the ZMQ stream's blocks before the first live batch: the snapshot's
    for b in zmq_batches[:start]:
        for e in b.events:
            if isinstance(e, BlockStored):
                state[_fold(e.block_hashes[0])] = (_fold(e.parent_block_hash), tuple(e.token_ids))
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    state.pop(_fold(h), None)
            else:
                state.clear()
    assert {e.stored.blocks[0].block_hash: (e.stored.parent_block_hash if e.stored.HasField("parent_block_hash")
                                            else None, tuple(e.stored.blocks[0].token_ids))
            for e in snapshot.events[1:]} == state
    matched = zmq_batches[start:start + len(live)]
    assert [b.ts for b in matched] == [b.timestamp for b in live]
    for ours, theirs in zip(live, matched, strict=True):
        assert len(ours.events) == len(theirs.events)
        for a, b in zip(ours.events, theirs.events, strict=True):
            assert_same_event(a, b)


def _next_snapshot(sub: zmq.Socket) -> KVEventBatch:
    """The next batch on `sub` that is a snapshot (AllBlocksCleared first; no flush runs meanwhile)."""
    while True:
        assert sub.poll(10_000), "no snapshot"
        batch = VLLM_DECODER.decode(sub.recv_multipart()[2])
        if batch.events and isinstance(batch.events[0], AllBlocksCleared):
            return batch


def test_a_router_joining_an_idle_replica_without_replay_learns_its_cache(fleet, processor):
    """An EPP (re)started with no replay port (llm-d-router v0.10.0 behind our overlay) subscribes to a
    replica that gets no more traffic: within --kv-events-snapshot-interval-s a snapshot reaches it
    (by batches alone none would come), and it is the whole cache: SubscribeKvEvents' snapshot block
    for block, the prompt just served included."""
    replicas, taps = fleet
    replica, tap = replicas[1], taps[1]
    words = "north south east west up down left right".split()
    text = " ".join(random.choices(words, k=30))
    with Client(replica.address) as c:
        c.generate([message("user", text_part(text))], max_tokens=2, temperature=0)
    context = zmq.Context()
    try:
        late = context.socket(zmq.SUB)
        late.connect(tap.endpoint)
        late.subscribe(b"kv@")
        _next_snapshot(late)   # nothing else would send a batch now
        with grpc.insecure_channel(replica.address) as channel:
            subscription = GrpcTap(vpb_grpc.VllmEngineStub(channel))
            (snapshot,) = subscription.wait(bool)
            subscription.cancel()
        zmq_snapshot = _next_snapshot(late)
    finally:
        context.destroy(linger=0)
    blocks = {_fold(e.block_hashes[0]): (_fold(e.parent_block_hash), tuple(e.token_ids))
              for e in zmq_snapshot.events[1:]}
    assert len(blocks) == len(zmq_snapshot.events) - 1
    assert blocks == {e.stored.blocks[0].block_hash: (e.stored.parent_block_hash if e.stored.HasField(
        "parent_block_hash") else None, tuple(e.stored.blocks[0].token_ids)) for e in snapshot.events[1:]}
    first = tuple(processor(TextInput(text)).prompt_token_ids[:BLOCK])
    assert (None, first) in blocks.values()
