"""KV events through a real AsyncEngine (tiny random Gemma 4, its core on a thread): a subscriber's
snapshot and live batches rebuild what the published pool caches, with the tokens a router sends;
a gateway's prompt (one anchor per video) is published in the gateway's tokens; flush clears and is
refused while requests run; a subscriber that does not read is dropped, not buffered without bound;
with no subscriber no event is built.

`RouterIndex` applies batches the way SMG's cache_aware index does (a block's position is its
parent's + 1; a request matches block by block from position 0 on the tokens of each block)."""

from __future__ import annotations

import asyncio
import contextlib
import random

import pytest
from engine_helpers import build_request, serve
from gemma4_fixtures import VIDEO

from mmserve.block_hash import block_hashes
from mmserve.config import EngineConfig
from mmserve.engine.async_engine import AsyncEngine
from mmserve.engine.kv_event_hub import Cleared, KvEventsLagError, Removed, Stored, block_id
from mmserve.engine.routing_prompt import RoutingPrompt, gateway_routing_prompt
from mmserve.engine.types import EngineRequest
from mmserve.errors import EngineUnavailableError
from mmserve.request import Request

BS = 4


class RouterIndex:
    def __init__(self):
        self.blocks: dict[int, tuple[int, tuple[int, ...]]] = {}   # hash -> (position, tokens)

    def apply(self, batch):
        for op in batch.ops:
            if isinstance(op, Cleared):
                self.blocks.clear()
            elif isinstance(op, Removed):
                for h in op.block_hashes:
                    self.blocks.pop(h, None)
            elif isinstance(op, Stored):
                assert len(op.token_ids) == BS
                if op.parent is None:
                    self.blocks[op.block_hash] = (0, op.token_ids)
                else:
                    assert op.parent in self.blocks, "a block published before its parent"
                    self.blocks[op.block_hash] = (self.blocks[op.parent][0] + 1, op.token_ids)

    def match(self, tokens) -> int:
        """Leading whole blocks of `tokens` some published block holds at the same position."""
        have = {(pos, toks) for pos, toks in self.blocks.values()}
        n = 0
        while (n + 1) * BS <= len(tokens) and (n, tuple(tokens[n * BS:(n + 1) * BS])) in have:
            n += 1
        return n


async def drain(it, index: RouterIndex, until, timeout: float = 20.0):
    """Apply batches from `it` until `until()` holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not until():
        index.apply(await asyncio.wait_for(it.__anext__(), max(0.01, deadline - loop.time())))


def run(load_backend, body, **options):
    model, tok = load_backend("reference")
    opts = dict(device="cpu", block_size=BS, num_kv_blocks=96, max_num_seqs=4, max_num_batched_tokens=64,
                prefill_batched_tokens=0)
    opts.update(options)
    engine = AsyncEngine(EngineConfig(**opts), model=model, tokenizer=tok)
    return serve(engine, body), engine


async def complete(engine, request):
    async with contextlib.aclosing(engine.generate(request)) as stream:   # cancelled: aborted at once
        outs = [out async for out in stream]
    return outs[-1]


def published_keys(engine) -> set[int]:
    pool = engine.core.kv.pools[engine.core.kv.published_pool]
    return {block_id(k) for k in pool._by_key}


def gateway_view(request: EngineRequest, anchor_at: int) -> RoutingPrompt:
    """The prompt a gateway sends for `request`: its media (from `anchor_at` to the end of the last
    range + its end marker) collapsed into one video anchor."""
    end = request.mm_ranges[-1][1] + 2
    ids = request.prompt_token_ids
    routing = gateway_routing_prompt(ids[:anchor_at] + [VIDEO] + ids[end:], ids, request.mm_ranges,
                                     [(anchor_at, len(request.mm_ranges))])
    assert routing is not None and routing.runs == ((anchor_at, anchor_at + 1, end - anchor_at),)
    return routing


def test_snapshot_and_live_batches_rebuild_the_cache(load_backend):
    async def body(engine):
        early = engine.subscribe_kv_events()
        index = RouterIndex()
        first = await early.__anext__()
        assert first.snapshot and first.ops == (Cleared(),)
        rng = random.Random(3)
        prompts = [build_request(f"t{i}", [rng.randint(9, 30)], seed=i % 3, max_tokens=rng.randint(1, 6))
                   for i in range(10)]   # seeds repeat: shared prefixes; 96 blocks: some get evicted
        for r in prompts:
            await complete(engine, r)
        await drain(early, index, lambda: set(index.blocks) == published_keys(engine))
        for r in prompts:   # every prompt whose blocks are still cached matches them, with its own tokens
            keys = block_hashes(Request(r.request_id, r.prompt_token_ids, r.sampling), BS, len(r.prompt_token_ids) // BS)
            cached = next((i for i, k in enumerate(keys) if block_id(k) not in index.blocks), len(keys))
            assert index.match(r.prompt_token_ids) >= cached
        late = RouterIndex()
        late.apply(await engine.subscribe_kv_events().__anext__())
        assert late.blocks == index.blocks

    run(load_backend, body)


def test_no_event_work_without_a_subscriber(load_backend):
    """Nobody subscribed: the core builds no events and the front end mirrors nothing, gateway views
    included. The first subscriber still gets everything cached (the core's snapshot); once the last
    one left and the linger ran out, both stop again."""
    async def idle_after(engine, deadline_s: float = 10.0) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        while engine.core.kv.events_on or engine.kv_events.recording:
            assert loop.time() < end, "events did not stop after the last subscriber left"
            await asyncio.sleep(0.01)

    def quiet(engine) -> None:
        assert not engine.kv_events.recording and not engine.core.kv.events_on
        assert engine.kv_events.num_blocks == 0 and not engine.kv_events._views

    async def body(engine):
        engine.kv_events.linger_s = 0.05
        video = build_request("v", [6, ("video", [8, 8, 4]), 9], seed=11, max_tokens=2)
        video.routing_prompt = gateway_view(video, 7)
        await complete(engine, build_request("a", [20], seed=1, max_tokens=2))
        await complete(engine, video)
        quiet(engine)
        sub = engine.subscribe_kv_events()
        index = RouterIndex()
        index.apply(await sub.__anext__())
        assert engine.core.kv.events_on and set(index.blocks) == published_keys(engine) != set()
        await sub.aclose()
        await idle_after(engine)
        quiet(engine)
        await complete(engine, build_request("b", [20], seed=2, max_tokens=2))
        quiet(engine)

    run(load_backend, body)


def test_a_gateway_prompt_is_published_in_the_gateway_tokens(load_backend):
    async def body(engine):
        sub = engine.subscribe_kv_events()
        index = RouterIndex()
        index.apply(await sub.__anext__())
        video = build_request("v", [6, ("video", [8, 8, 4]), 9], seed=11, max_tokens=2)
        video.routing_prompt = gateway_view(video, 7)
        await complete(engine, video)
        routed = video.routing_prompt.token_ids
        await drain(sub, index, lambda: index.match(routed) == len(routed) // BS)
        assert index.match(video.prompt_token_ids) == 7 // BS, "our expanded tokens match only up to the anchor"
        # The same video asked another question: the gateway's ids share everything up to the question.
        follow = build_request("f", [6, ("video", [8, 8, 4]), 9], seed=11, max_tokens=2)
        follow.prompt_token_ids[-3:] = [30, 31, 32]
        follow.routing_prompt = gateway_view(follow, 7)
        assert index.match(follow.routing_prompt.token_ids) == (len(routed) - 3) // BS
        out = await complete(engine, follow)
        assert out.usage.cached_tokens >= video.mm_ranges[-1][1] - BS   # it really was served from the cache
        # A different video asked the same question: the same gateway tokens, other hashes.
        other = build_request("o", [6, ("video", [8, 8, 4]), 9], seed=11, max_tokens=2)
        other.mm_inputs = build_request("x", [6, ("video", [8, 8, 4]), 9], seed=12).mm_inputs
        other.routing_prompt = gateway_view(other, 7)
        before = set(index.blocks)
        await complete(engine, other)
        await drain(sub, index, lambda: len(set(index.blocks) - before) >= len(routed) // BS - 7 // BS)
        assert set(index.blocks) == set(engine.kv_events._blocks)

    run(load_backend, body)


def test_flush_clears_and_is_refused_while_a_request_runs(load_backend):
    """The flush is sent once the long request has streamed a token (it runs in the core) and holds
    the whole context (~1000 steps it cannot finish first); closing its stream aborts it."""
    async def body(engine):
        await complete(engine, build_request("a", [20], seed=1, max_tokens=2))
        sub = engine.subscribe_kv_events()
        index = RouterIndex()
        index.apply(await sub.__anext__())
        assert index.blocks
        held = build_request("b", [12], seed=2, max_tokens=engine.model_info.context_length - 13)   # BOS + 12
        async with contextlib.aclosing(engine.generate(held)) as stream:
            first = await stream.__anext__()
            assert first.new_token_ids and not first.finished
            assert await engine.flush_prefix_cache() is False
        assert await engine.flush_prefix_cache(timeout_s=10.0) is True   # once the abort freed it
        await drain(sub, index, lambda: not index.blocks)
        again = await complete(engine, build_request("a2", [20], seed=1, max_tokens=2))
        assert again.usage.cached_tokens == 0

    run(load_backend, body, num_kv_blocks=300)   # room for the whole context


def test_a_subscriber_that_does_not_read_is_dropped(load_backend):
    async def body(engine):
        slow = engine.subscribe_kv_events()
        assert (await slow.__anext__()).snapshot
        for i in range(3):   # 3 x 9 stored blocks > 8 buffered
            await complete(engine, build_request(f"s{i}", [36], seed=20 + i, max_tokens=1))
        assert engine.kv_events.num_subscribers == 0
        with pytest.raises(KvEventsLagError, match="subscribe again"):
            while True:
                await slow.__anext__()
        ended = engine.subscribe_kv_events()
        assert (await ended.__anext__()).snapshot
        await engine.shutdown()   # the engine's end ends every subscription
        with pytest.raises(EngineUnavailableError):
            await ended.__anext__()

    run(load_backend, body, kv_events_buffer=8)


def test_a_long_chain_and_its_descendants_leave_with_the_key_they_rest_on():
    """No recursion over a chain (a long video is thousands of blocks), and a removal reaches every
    descendant, once."""
    from mmserve.engine.kv_event_hub import KvEventHub
    from mmserve.ipc.kv_cache_events import BlockRemoved, BlockStored

    hub = KvEventHub(block_size=BS, max_buffered=10**6)   # no core: this test feeds it

    async def body():
        listener = hub.subscribe()   # the hub mirrors only while someone listens
        await listener.__anext__()
        keys = [bytes([i % 256, i // 256]) + bytes(30) for i in range(5000)]
        hub.apply([BlockStored(k, keys[i - 1] if i else None, i, (i, i, i, i), "r") for i, k in enumerate(keys)])
        assert hub.num_blocks == 5000
        index = RouterIndex()
        index.apply(hub.snapshot())
        assert len(index.blocks) == 5000 and index.match([t for i in range(5000) for t in (i, i, i, i)]) == 5000
        hub.apply([BlockRemoved(keys[10])])
        assert hub.num_blocks == 10
        index.apply(hub.snapshot())
        assert len(index.blocks) == 10
        await listener.aclose()

    asyncio.run(body())


def test_a_snapshot_larger_than_the_buffer_does_not_drop_its_subscriber():
    from mmserve.engine.kv_event_hub import KvEventHub
    from mmserve.ipc.kv_cache_events import BlockStored

    hub = KvEventHub(block_size=BS, max_buffered=4)   # no core: this test feeds it
    keys = [bytes([i]) + bytes(31) for i in range(12)]

    async def body():
        first = hub.subscribe()   # it has read everything, so it takes the 10 blocks in one batch
        await first.__anext__()
        hub.apply([BlockStored(k, keys[i - 1] if i else None, i, (i,) * BS, "r") for i, k in enumerate(keys[:10])])
        await first.aclose()
        sub = hub.subscribe()
        assert len((await sub.__anext__()).ops) == 11   # a clear + 10 blocks, more than the buffer holds
        hub.apply([BlockStored(keys[10], keys[9], 10, (10,) * BS, "r")])
        hub.apply([BlockStored(keys[11], keys[10], 11, (11,) * BS, "r")])
        assert hub.num_subscribers == 1
        got = [(await sub.__anext__()).ops[0].block_hash for _ in range(2)]
        assert got == [block_id(keys[10]), block_id(keys[11])]
        await sub.aclose()

    asyncio.run(body())
