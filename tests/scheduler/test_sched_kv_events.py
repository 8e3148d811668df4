"""The prefix cache's published events, without a model: replaying them must rebuild exactly the
keys the published (full-attention) pool holds, every stored block must chain on a block already
published and carry the tokens its key was computed from, and a flush is refused while requests
hold blocks. None is built while events are off; switching them on starts with a snapshot of the
whole cache, which replays to the same keys."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import torch
from sched_helpers import FULL, admit, make_request, make_scheduler, random_ranges, run_to_completion, step

from mmserve.block_hash import ROOT_KEY
from mmserve.ipc.kv_cache_events import BlockRemoved, BlockStored, CacheCleared, EventsStarted
from mmserve.request import MultiModalInput


class Replay:
    """What a subscriber knows after applying every event so far."""

    def __init__(self):
        self.keys: dict[bytes, tuple[int, ...]] = {}
        self.removed = 0

    def apply(self, events):
        for e in events:
            if isinstance(e, BlockStored):
                assert e.key not in self.keys, "a key stored twice without a removal"
                assert (e.parent is None) == (e.index == 0)
                assert e.parent is None or e.parent in self.keys, "a block stored before its parent"
                assert e.key == _text_key(e.parent, e.token_ids), "tokens are not what the key names"
                self.keys[e.key] = e.token_ids
            elif isinstance(e, BlockRemoved):
                del self.keys[e.key]
                self.removed += 1
            elif isinstance(e, CacheCleared | EventsStarted):
                self.keys.clear()


def _text_key(parent, tokens):
    h = hashlib.sha256(parent if parent is not None else ROOT_KEY)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


def _published_keys(sched) -> set[bytes]:
    pool = sched.kv.pools[sched.kv.published_pool]
    return set(pool._by_key)


def test_events_replay_to_the_published_pool_under_eviction_and_flush():
    rng = random.Random(7)
    sched = make_scheduler(num_blocks=40, block_size=4)   # small: shared prefixes get evicted
    assert sched.kv.published_pool == FULL
    sched.kv.set_events(True)
    replay = Replay()
    n = 0
    for _ in range(12):
        for _ in range(rng.randint(1, 4)):
            # a few prompt families sharing prefixes (same `first`), of random lengths
            admit(sched, make_request(f"r{n}", rng.randint(3, 40), first=rng.choice([3, 100, 200]),
                                           max_tokens=rng.randint(1, 9)))
            n += 1
        run_to_completion(sched, on_step=lambda out: replay.apply(sched.kv.take_events()))
        replay.apply(sched.kv.take_events())
        assert set(replay.keys) == _published_keys(sched)
    assert replay.keys and replay.removed, "the load should have stored and evicted keys"
    assert sched.kv.flush()
    replay.apply(sched.kv.take_events())
    assert replay.keys == {} and _published_keys(sched) == set()


def test_flush_is_refused_while_a_request_holds_blocks():
    sched = make_scheduler(num_blocks=64, block_size=4)
    sched.kv.set_events(True)
    assert sched.kv.take_events() == [EventsStarted()]   # nothing cached yet
    admit(sched, make_request("a", 20, max_tokens=8))
    step(sched)
    assert sched.kv.take_events(), "a computed prompt block publishes a key"
    assert not sched.kv.flush() and sched.kv.take_events() == []
    run_to_completion(sched)
    assert sched.kv.flush()
    assert sched.kv.take_events()[-1] == CacheCleared()
    admit(sched, make_request("b", 20, max_tokens=1))   # same prompt: computed again, nothing reused
    assert step(sched).scheduled[0].num_computed_tokens == 0


def test_no_event_is_built_while_off_and_switching_on_snapshots_the_whole_cache():
    rng = random.Random(11)
    sched = make_scheduler(num_blocks=40, block_size=4)
    built = []
    n = 0

    def load(rounds: int) -> None:
        nonlocal n
        for _ in range(rounds):
            for _ in range(rng.randint(1, 4)):
                admit(sched, make_request(f"r{n}", rng.randint(3, 40), first=rng.choice([3, 100, 200]),
                                               max_tokens=rng.randint(1, 9)))
                n += 1
            run_to_completion(sched, on_step=lambda out: built.extend(sched.kv.take_events()))

    load(8)   # stores, evictions and a flush, with nobody listening
    assert sched.kv.flush()
    load(4)
    assert built == [] and sched.kv.take_events() == [] and _published_keys(sched)
    for _ in range(2):   # on, and on again (a resync): each time a snapshot of everything cached
        sched.kv.set_events(True)
        events = sched.kv.take_events()
        assert events[0] == EventsStarted() and all(isinstance(e, BlockStored) for e in events[1:])
        replay = Replay()
        replay.apply(events)
        assert set(replay.keys) == _published_keys(sched)
    load(4)   # live events go on from the snapshot
    replay.apply(built)
    replay.apply(sched.kv.take_events())
    assert set(replay.keys) == _published_keys(sched)
    sched.kv.set_events(False)
    built.clear()
    load(3)
    assert built == [] and sched.kv.take_events() == []



def _key(parent: bytes | None, tokens, extra_keys) -> bytes:
    """block_hash's key as its docstring defines it, from what an event publishes."""
    h = hashlib.sha256(parent if parent is not None else ROOT_KEY)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    for identifier, offset in extra_keys or ():
        h.update(bytes.fromhex(identifier))
        h.update(offset.to_bytes(8, "little", signed=True))
    return h.digest()


def test_stored_blocks_carry_their_images_as_extra_keys_that_rebuild_the_key():
    """Each stored block names the images/frames overlapping it as vLLM publishes them, (content
    hash hex, range start - block start): with its tokens and parent they are exactly what went into
    its key, in the live events and in a snapshot. Two prompts with the same tokens and placeholder
    runs but other pixels share only the blocks before the first image."""
    rng = random.Random(5)
    bs = 4
    sched = make_scheduler(num_blocks=256, block_size=bs, max_num_batched_tokens=64)
    sched.kv.set_events(True)
    sched.kv.take_events()
    ranges = random_ranges(rng, 70, max_len=9, density=0.3)
    assert any(s // bs != e // bs for s, e in ranges), "a range should span blocks (negative offsets)"
    stored: dict[str, list[BlockStored]] = {}
    hashes: dict[str, list[bytes]] = {}
    for rid in ("a", "b"):   # same tokens, same ranges, other content
        hashes[rid] = [rng.randbytes(32) for _ in ranges]
        items = [MultiModalInput(torch.zeros(1, 1), torch.zeros(1, 2), content_hash=h) for h in hashes[rid]]
        admit(sched, make_request(rid, 72, ranges, max_tokens=2, mm_inputs=items))
        run_to_completion(sched)
        stored[rid] = [e for e in sched.kv.take_events() if isinstance(e, BlockStored)]
    for rid, events in stored.items():
        for e in events:
            first = e.index * bs
            want = tuple((h.hex(), start - first) for (start, end), h in zip(ranges, hashes[rid], strict=True)
                         if start < first + bs and end >= first)
            assert e.extra_keys == (want or None)
            assert e.key == _key(e.parent, e.token_ids, e.extra_keys)
    a_keys = {e.key for e in stored["a"]}
    first_image = ranges[0][0] // bs
    assert [e.index for e in stored["b"]][0] == first_image, "b reuses a's blocks before the first image"
    assert not a_keys & {e.key for e in stored["b"]}
    assert any(e.extra_keys and e.extra_keys[0][1] < 0 for e in stored["a"])
    sched.kv.set_events(True)   # a snapshot carries the same extra keys
    snapshot = {e.key: e.extra_keys for e in sched.kv.take_events() if isinstance(e, BlockStored)}
    assert snapshot == {e.key: e.extra_keys for events in stored.values() for e in events}
