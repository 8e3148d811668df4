"""Prefix caching without a model: block pool LRU and reference counts, chained keys, the hit rules
(last token, frames, sliding windows), sharing for parallel samples, and a random load whose every
hit is checked against what was really written into the blocks it reuses."""

from __future__ import annotations

import random

import pytest
import torch
from sched_helpers import FULL, SLIDING, make_kv, make_scheduler, run_to_completion, step
from sched_helpers import admit as schedule_admit

from mmserve.block_hash import block_hashes
from mmserve.core.kv_cache.block_pool import BlockPool
from mmserve.core.kv_cache.manager import NULL_BLOCK, KVCacheManager
from mmserve.core.kv_cache.planner import PoolPlan
from mmserve.request import MultiModalInput, Request
from mmserve.sampling_params import SamplingParams


def item(seed: int, patches: int = 4) -> MultiModalInput:
    gen = torch.Generator().manual_seed(seed)
    return MultiModalInput(torch.rand(patches, 48, generator=gen), torch.zeros(patches, 2, dtype=torch.long))


def request(rid: str, tokens: list[int], ranges=(), items=(), max_tokens: int = 4) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), mm_ranges=list(ranges),
                   mm_inputs=list(items))


def compute(kv, r: Request, n: int) -> None:
    """Pretend a step computed the request's next n tokens."""
    assert kv.allocate(r, n)
    r.num_computed_tokens += n
    kv.cache_blocks(r)


def admit(kv, r: Request) -> int:
    """Admit with the longest hit and compute the rest of the prompt; returns the hit length."""
    hit = kv.find_cached_prefix(r)
    assert kv.allocate(r, r.num_tokens - hit.num_tokens, hit)
    r.num_computed_tokens = r.num_tokens
    kv.cache_blocks(r)
    return hit.num_tokens


def test_pool_reuses_empty_blocks_first_then_evicts_the_least_recently_freed():
    pool = BlockPool(6)
    a = pool.take(3)
    for b in a:
        pool.cache(b, bytes([b]))
    pool.release(reversed(a))                    # tail first: a[2] is the least recently freed
    assert pool.num_free == 5 and pool.num_cached_free == 3
    assert sorted(pool.take(2)) == [4, 5]        # empty blocks before any cached one
    assert pool.take(1) == [a[2]] and pool.lookup(bytes([a[2]])) is None
    pool.touch([a[0]])                           # a hit takes a cached block off the free list
    assert pool.num_free == 1 and pool.ref_cnt[a[0]] == 1
    pool.release([a[0]])
    assert pool.lookup(bytes([a[0]])) == a[0] and pool.num_free == 2
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([a[0]])
    with pytest.raises(RuntimeError, match="3 blocks asked"):
        pool.take(3)


def test_keys_name_the_whole_prefix_and_each_items_content_and_place():
    bs, tokens = 4, list(range(20, 44))
    tokens[6:14] = [9] * 8
    keys = block_hashes(request("a", tokens, [(6, 13)], [item(1)]), bs, 6)
    assert len(set(keys)) == 6
    assert block_hashes(request("b", tokens, [(6, 13)], [item(1)]), bs, 6) == keys    # same bytes, same keys
    other = block_hashes(request("c", tokens, [(6, 13)], [item(2)]), bs, 6)           # other pixels
    assert other[0] == keys[0] and all(o != k for o, k in zip(other[1:], keys[1:], strict=True))
    moved = list(tokens)
    moved[6:15] = [9] * 9
    shifted = block_hashes(request("d", moved, [(7, 14)], [item(1)]), bs, 6)          # same item one later
    assert shifted[0] == keys[0] and shifted[1] != keys[1]
    changed = [tokens[0] + 1] + tokens[1:]
    assert all(c != k for c, k in zip(block_hashes(request("e", changed, [(6, 13)], [item(1)]), bs, 6), keys,
                                      strict=True))
    assert block_hashes(request("f", tokens, [(6, 13)]), bs, 6) == keys[:1]           # unnamed item: no key


def test_hit_leaves_the_last_token_to_compute_and_is_whole_blocks():
    kv = make_kv(num_blocks=64)
    a = request("a", list(range(3, 23)))          # 20 tokens: 5 full blocks
    assert admit(kv, a) == 0
    assert admit(kv, request("b", list(range(3, 23)))) == 16          # the 20th token's logits are needed
    assert admit(kv, request("c", list(range(3, 24)))) == 20
    assert admit(kv, request("d", list(range(3, 14)) + [99] * 9)) == 8  # differs inside block 2


def test_prompt_logprobs_read_nothing_from_the_cache_but_fill_it():
    kv = make_kv(num_blocks=64)
    admit(kv, request("a", list(range(3, 23))))
    b = Request("b", list(range(3, 23)), SamplingParams(max_tokens=4, prompt_logprobs=True))
    assert admit(kv, b) == 0                      # every prompt token's logits are needed
    kv.free("a")
    kv.free("b")
    assert admit(kv, request("c", list(range(3, 23)))) == 16


@pytest.mark.parametrize("frame, shared, expected", [
    ((6, 13), 14, 4),     # the 12-token boundary is inside the frame: back to its start, down to a block
    ((8, 13), 14, 8),     # the frame starts on a block boundary: everything before it
    ((8, 11), 14, 12),    # the frame ends before the boundary: untouched
])
def test_hit_never_ends_inside_a_frame(frame, shared, expected):
    kv = make_kv(num_blocks=64)
    tokens = list(range(3, 27))
    admit(kv, request("a", tokens, [frame], [item(5)]))
    b = request("b", tokens[:shared] + [99] * (24 - shared), [frame], [item(5)])
    hit = kv.find_cached_prefix(b)
    assert hit.num_tokens == expected
    s, e = frame
    assert not s < hit.num_tokens <= e


def test_a_preempted_request_of_whole_blocks_never_hits_its_last_token():
    """A request preempted after every token of it was computed, its length a whole number of blocks,
    holds keys for all of them; its own lookup on readmission took them all (a hit on every token,
    so a first chunk of 0 tokens, at which admission stopped every step: the engine stalled with
    free blocks, found by a randomized driver). The hit ends a block short, as for any request."""
    kv = make_kv(num_blocks=64)
    r = request("r", list(range(3, 35)), max_tokens=16)
    compute(kv, r, 32)
    for token in range(100, 108):   # decodes until its 40 tokens are all computed: 10 whole blocks keyed
        r.output_token_ids.append(token)
        compute(kv, r, 1)
    assert r.num_tokens == r.num_computed_tokens == 40 and len(r.block_hashes) == 10
    kv.free("r")   # preempted
    r.num_computed_tokens = 0
    hit = kv.find_cached_prefix(r)
    assert hit.num_tokens == 36 and kv.allocate(r, r.num_tokens - hit.num_tokens, hit)


def test_windowed_pool_needs_only_the_blocks_its_window_reaches():
    kv = make_kv(num_blocks=64)                   # window 8, block size 4
    a = request("a", list(range(3, 43)))          # 40 tokens in one chunk: all 10 sliding blocks held
    compute(kv, a, 40)
    sliding = kv.block_table("a", SLIDING)
    kv.free("a")                                  # tail first: sliding block 9 is now the LRU victim
    pool = kv.pools[SLIDING]
    hit = kv.find_cached_prefix(request("b", list(range(3, 44))))
    assert hit.num_tokens == 40
    assert hit.blocks[SLIDING] == [NULL_BLOCK] * 8 + sliding[8:10]   # keys 33..39 only
    assert len(hit.blocks[FULL]) == 10 and NULL_BLOCK not in hit.blocks[FULL]
    pool.take(pool.num_free - pool.num_cached_free + 1)   # the empty blocks, then exactly sliding block 9
    assert pool.lookup(block_hashes(a, 4, 10)[9]) is None
    b = request("b2", list(range(3, 44)))
    hit = kv.find_cached_prefix(b)
    # The full pool still has all 10 blocks, but at 40 the window needs block 9: the longest usable
    # hit is 36, whose window (keys 29..35) lies in blocks 7 and 8.
    assert hit.num_tokens == 36 and hit.blocks[SLIDING] == [NULL_BLOCK] * 7 + sliding[7:9]


def test_a_long_prefill_recycles_its_own_window_instead_of_flushing_the_cache():
    # A sliding pool as small as plan_pools makes it (room for what running requests hold), and a
    # full pool with room to spare.
    plans = {SLIDING: PoolPlan(SLIDING, 12, 4, 1, 8), FULL: PoolPlan(FULL, 128, 2, 1, None)}
    kv = KVCacheManager(plans, 4, max_model_len=512)
    a = request("a", list(range(3, 43)))
    for _ in range(5):
        compute(kv, a, 8)
    kv.free("a")                                  # a's window tail (keys 33..39) stays cached
    c = request("c", list(range(100, 260)))       # then a long unrelated prompt streams through
    for _ in range(20):
        compute(kv, c, 8)
    kv.free("c")
    assert kv.find_cached_prefix(request("b", list(range(3, 44)))).num_tokens == 40


def test_a_new_question_about_the_same_media_finds_the_window_before_its_end_still_cached():
    # A prompt's frame ends at 26 (its closing token at 27); another question about it shares
    # [0, 28), and a hit of 28 needs the sliding blocks of keys 21..27 (blocks 5 and 6), which the
    # window left behind while the first question was computed. A long unrelated prompt streaming
    # through a small sliding pool must not evict them.
    plans = {SLIDING: PoolPlan(SLIDING, 12, 4, 1, 8), FULL: PoolPlan(FULL, 128, 2, 1, None)}
    kv = KVCacheManager(plans, 4, max_model_len=512)
    frame = [(17, 26)]
    a = request("a", list(range(3, 51)), frame, [item(5)])
    for _ in range(6):
        compute(kv, a, 8)
    assert kv.block_table("a", SLIDING)[5:7] == [NULL_BLOCK] * 2   # reclaimed while a ran
    kv.free("a")
    c = request("c", list(range(100, 260)))
    for _ in range(20):
        compute(kv, c, 8)
    kv.free("c")
    b = request("b", list(range(3, 31)) + [99] * 20, frame, [item(5)])
    assert kv.find_cached_prefix(b).num_tokens == 28


def test_a_request_waits_for_the_prefix_a_running_one_is_computing():
    sched = make_scheduler(num_blocks=256, max_num_batched_tokens=24, max_num_seqs=4)
    doc = list(range(3, 63))                      # 60 shared tokens: three steps for the first request
    for r in (request("a", doc + [70], max_tokens=2), request("b", doc + [71], max_tokens=2),
              request("c", list(range(100, 110)), max_tokens=2)):
        schedule_admit(sched, r)
    admitted, steps = {}, [0]

    def note(out):
        steps[0] += 1
        for s in out.scheduled:
            if s.num_cached_tokens is not None:
                admitted[s.request.request_id] = (steps[0], s.num_cached_tokens)

    run_to_completion(sched, note)
    # a fills the budget for two steps; in the third, b (next in line) would compute a's blocks
    # beside a, so it waits and the rest of the budget goes to c; b then starts after the 60 tokens.
    assert admitted["a"] == (1, 0) and admitted["c"] == (3, 0) and admitted["b"] == (4, 60)


def test_a_hit_shares_blocks_by_reference_and_frees_exactly():
    kv = make_kv(num_blocks=64)
    a = request("a", list(range(3, 23)), max_tokens=8)
    compute(kv, a, 20)                            # a keeps running
    b = request("b", list(range(3, 25)))
    assert admit(kv, b) == 20
    shared = kv.block_table("a", FULL)
    assert kv.block_table("b", FULL)[:5] == shared
    assert all(kv.pools[FULL].ref_cnt[x] == 2 for x in shared)
    kv.free("a")
    assert all(kv.pools[FULL].ref_cnt[x] == 1 for x in shared)
    kv.free("b")
    for p in kv.pools.values():
        assert p.num_free == p.num_usable and not any(p.ref_cnt)
    assert kv.pools[FULL].num_cached_free == 5    # b's partial sixth block is not keyed
    assert kv.usage() == 0.0 and kv.cached_usage() == 5 / 63


def test_share_prefix_forks_all_but_the_last_prompt_token_and_copies_the_partial_block():
    kv = make_kv(num_blocks=64)
    kv.enable_prefix_caching = False              # sharing does not need the cache
    parent = request("p", list(range(3, 22)))     # 19 tokens: the child computes only token 18
    compute(kv, parent, 19)
    child = request("p#1", list(range(3, 22)))
    hit = kv.share_prefix(parent, child)
    assert hit.num_tokens == 18
    assert kv.allocate(child, 1, hit)
    p_full, c_full = kv.block_table("p", FULL), kv.block_table("p#1", FULL)
    assert c_full[:4] == p_full[:4] and c_full[4] != p_full[4]   # whole blocks shared, the partial one its own
    assert all(kv.pools[FULL].ref_cnt[x] == 2 for x in p_full[:4])
    p_win, c_win = kv.block_table("p", SLIDING), kv.block_table("p#1", SLIDING)
    assert c_win[:2] == [NULL_BLOCK] * 2 and c_win[2:4] == p_win[2:4]   # window 8 from token 18: keys 11..17
    assert kv.take_block_copies() == {FULL: [(p_full[4], c_full[4])], SLIDING: [(p_win[4], c_win[4])]}
    assert kv.take_block_copies() == {}
    with pytest.raises(ValueError, match="does not share"):
        kv.share_prefix(parent, request("q", [1] + list(range(4, 22))))
    kv.free("p")
    kv.free("p#1")
    assert all(p.num_free == p.num_usable and not any(p.ref_cnt) for p in kv.pools.values())


def test_share_prefix_stops_at_a_frame_and_needs_the_parents_window():
    kv = make_kv(num_blocks=64)
    tokens = list(range(3, 33))
    parent = request("p", tokens, [(20, 29)], [item(1)])   # the prompt ends with a frame
    compute(kv, parent, 30)
    hit = kv.share_prefix(parent, request("p#1", tokens, [(20, 29)], [item(1)]))
    assert hit.num_tokens == 20 and not hit.copy_from   # the child computes the frame (20 is a block boundary)
    parent.output_token_ids += [7] * 12
    compute(kv, parent, 12)   # the parent decodes on: its window leaves the prompt's end behind
    assert kv.share_prefix(parent, request("p#2", tokens, [(20, 29)], [item(1)])).num_tokens == 0


def _identity(r: Request, j: int, bs: int) -> tuple:
    """What block j of a request holds: every token up to its end and every item that began before it."""
    end = (j + 1) * bs
    items = tuple((s, e, r.mm_inputs[i].content_hash) for i, (s, e) in enumerate(r.mm_ranges) if s < end)
    return tuple(r.token_ids_slice(0, end)), items


@pytest.mark.parametrize("seed", range(3))
def test_random_load_only_ever_reuses_blocks_holding_the_same_prefix(seed):
    """Shared documents with frames, random suffixes, a pool small enough to evict and preempt: each
    reused block must hold exactly the prefix the hitting request would have computed there."""
    rng = random.Random(seed)
    bs = 4
    docs = []
    for d in range(3):
        tokens, ranges, items = [], [], []
        while len(tokens) < 40:
            tokens += [rng.randrange(20, 60) for _ in range(rng.randint(1, 6))]
            n = rng.randint(2, 8)
            ranges.append((len(tokens), len(tokens) + n - 1))
            items.append(item(100 * seed + 10 * d + len(items)))
            tokens += [9] * n
        docs.append((tokens, ranges, items))
    sched = make_scheduler(num_blocks=26, block_size=bs, max_num_batched_tokens=24, max_num_seqs=4)
    for i in range(24):
        tokens, ranges, items = docs[rng.randrange(3)]
        cut = rng.randint(1, len(tokens))        # a random prefix of a document, frames kept whole ...
        for s, e in ranges:
            if s < cut <= e:
                cut = s
        kept = [k for k, (_, e) in enumerate(ranges) if e < cut]
        suffix = [rng.randrange(20, 60) for _ in range(rng.randint(1, 12))]   # ... and a question of its own
        schedule_admit(sched, request(f"r{i}", tokens[:cut] + suffix, [ranges[k] for k in kept],
                                  [items[k] for k in kept], max_tokens=rng.randint(1, 6)))
    written = {FULL: {}, SLIDING: {}}
    reused = preempted = 0

    def check(out):
        nonlocal reused, preempted
        preempted += len(out.preempted_ids)
        for s in out.scheduled:
            for j in range((s.num_cached_tokens or 0) // bs):
                for t in written:
                    block = sched.kv.block_table(s.request.request_id, t)[j]
                    if block != NULL_BLOCK:
                        assert written[t][block] == _identity(s.request, j, bs)
                        reused += 1

    def record(out):
        for s in out.scheduled:
            r = s.request
            for j in range(s.num_computed_tokens // bs, r.num_computed_tokens // bs):
                for t in written:
                    block = sched.kv.block_table(r.request_id, t)[j]
                    if block != NULL_BLOCK:
                        written[t][block] = _identity(r, j, bs)

    for _ in range(10_000):
        if not (sched.running or sched.waiting):
            break
        out = step(sched, check)
        record(out)
        for s in out.scheduled:
            if len(s.request.output_token_ids) >= s.request.sampling_params.max_tokens:
                sched.finish(s.request.request_id)
    assert not (sched.running or sched.waiting)
    assert reused > 0 and preempted > 0, (reused, preempted)
    for p in sched.kv.pools.values():
        assert p.num_free == p.num_usable and not any(p.ref_cnt)
