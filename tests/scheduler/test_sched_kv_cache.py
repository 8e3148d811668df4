"""KV block pools: sizing, all-or-nothing allocation, sliding-window reclamation, freeing."""

from __future__ import annotations

import random

from sched_helpers import LAYER_TYPES, SPECS, admit, make_kv, make_request, random_ranges

from mmserve.attention.backend import FULL, SLIDING
from mmserve.core.kv_cache.manager import NULL_BLOCK
from mmserve.core.kv_cache.planner import plan_pools


def test_pools_of_a_given_block_count_cost_their_layers_bytes():
    # sliding: 4 layers * 2 * bs4 * 2 heads * 16 * 4 B = 4096 B; full: 2 * 2 * 4 * 1 * 32 * 4 = 2048 B
    plans = plan_pools(LAYER_TYPES, SPECS, block_size=4, dtype_bytes=4, num_kv_blocks=10).pools
    assert plans[SLIDING].bytes_per_block == 4 * 2 * 4 * 2 * 16 * 4
    assert plans[FULL].bytes_per_block == 2 * 2 * 4 * 1 * 32 * 4
    assert plans[SLIDING].num_blocks == plans[FULL].num_blocks == 10
    assert plans[SLIDING].window == 8 and plans[FULL].window is None


def test_allocation_is_all_pools_or_nothing():
    kv = make_kv(num_blocks=5)   # 4 usable per pool, block size 4
    a = make_request("a", 12)
    assert kv.allocate(a, 12)
    b = make_request("b", 8)
    assert not kv.allocate(b, 8)
    assert kv.pools[SLIDING].num_free == kv.pools[FULL].num_free == 1
    assert kv.block_table("b", FULL) == []
    kv.free("a")
    assert kv.allocate(b, 8) and kv.usage() == 0.5


def test_sliding_blocks_outside_the_window_return_to_the_pool():
    kv = make_kv(num_blocks=200)   # window 8, block size 4
    r = make_request("long", 400, max_tokens=1)
    held = []
    while r.num_computed_tokens < 400:
        n = min(13, 400 - r.num_computed_tokens)
        assert kv.allocate(r, n)
        table = kv.block_table("long", SLIDING)
        first_needed = max(0, r.num_computed_tokens - 8 + 1)
        # every block a query in this chunk can still see is real; older ones point at the null block
        for j, b in enumerate(table):
            if (j + 1) * 4 - 1 >= first_needed:
                assert b != NULL_BLOCK
        held.append(kv.num_held("long", SLIDING))
        r.num_computed_tokens += n
    assert max(held) <= (8 + 13) // 4 + 2
    assert kv.num_held("long", FULL) == 100
    kv.free("long")
    assert all(p.num_free == p.num_usable for p in kv.pools.values())


def test_open_range_keeps_its_start_for_unclamped_layers():
    kv = make_kv(num_blocks=64)
    r = make_request("v", 64, [(10, 40)])
    r.num_computed_tokens = 30   # only reachable if a range was split; the guard keeps its keys anyway
    assert kv.allocate(r, 4)
    table = kv.block_table("v", SLIDING)
    assert all(b != NULL_BLOCK for b in table[10 // 4:])


def test_a_verify_chunk_in_flight_keeps_the_window_of_the_lowest_next_row():
    """Async scheduling with speculation counts a verify chunk's rows computed (placeholders: its
    token, drafts and pads) when it launches it, and releases windows for the next step before the
    chunk's rejections are known: with no draft kept, the next row runs K positions lower. Every key
    that row attends to stays in a held block, after the release and the next step's allocation
    (window 8, block size 4: every prompt length over four blocks, chunks of 2 to 5 rows)."""
    for prompt in range(1, 17):
        for rows in range(2, 6):
            kv = make_kv(num_blocks=64)
            r = make_request("r", prompt, max_tokens=50)
            assert kv.allocate(r, prompt)
            r.num_computed_tokens = prompt
            assert kv.allocate(r, rows)   # the verify chunk, counted as computed at launch
            r.num_computed_tokens += rows
            r.num_output_placeholders = rows
            lowest = prompt + 1   # the next row if the chunk keeps only the token its first row samples
            kv.release_out_of_window([r])
            assert_holds(kv.block_table("r", SLIDING), lowest, (prompt, rows))
            assert kv.allocate(r, rows)   # the next step's chunk (allocation releases too)
            assert_holds(kv.block_table("r", SLIDING), lowest, (prompt, rows))


def assert_holds(table: list[int], pos: int, why) -> None:
    """Every key a query at `pos` attends to (window 8, block size 4) is in a held block."""
    lost = [key for key in range(max(0, pos - 8 + 1), pos + 1) if table[key // 4] == NULL_BLOCK]
    assert not lost, (why, table, lost)


def test_a_request_the_step_leaves_out_keeps_only_its_window():
    """The planner reserves each request its window, and one step's tokens between them all: a request
    a step skips must not keep the chunk it computed before (window 8, block size 4)."""
    from sched_helpers import make_scheduler, step

    sched = make_scheduler(max_num_batched_tokens=16)
    admit(sched, make_request("a", 100, [(1, 16)], first=3))   # its first chunk stops before the frame
    admit(sched, make_request("b", 60, first=200))
    out = step(sched)
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("b", 15)]
    assert sched.kv.num_held("b", SLIDING) == 4   # keys 0..14
    out = step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["a"]   # the frame takes the whole budget
    assert sched.kv.num_held("b", SLIDING) == 2   # keys 8..14: what its next query (15) can reach


def _first_kept(ranges, pos: int, window: int) -> int:
    """From scratch: the oldest position a query at `pos` or later attends to in a windowed pool
    (a media range still open at `pos` keeps its start)."""
    if pos == 0:
        return 0
    first = max(0, pos - window + 1)
    for a, b in ranges:
        if a < pos <= b:
            first = min(first, a)
    return first


def _released(kv, rid: str, layer_type: str) -> int:
    """Leading entries of the request's table in the pool that are released (the null block)."""
    table = kv.block_table(rid, layer_type)
    return next((i for i, b in enumerate(table) if b != NULL_BLOCK), len(table))


def test_released_window_entries_equal_their_definition_at_every_step():
    """Allocation and the per-step release skip the window search until the window's first key
    crosses a block: after each call, a windowed pool's released (null) leading entries are exactly
    max(those before, the block of the first key kept, within the table), on prompts with media
    ranges and random chunk sizes (fresh seeds), and random placeholders of a step in flight (async
    scheduling: the first key kept is that of the lowest next row, all placeholders but one below
    the count); it fails if a release is skipped or comes early."""
    for _ in range(30):
        seed = random.randrange(2**31)
        rng = random.Random(seed)
        kv = make_kv(512)
        n = rng.randint(2, 150)
        ranges = random_ranges(rng, n, max_len=10)
        r = make_request("r", n, ranges)
        windowed = {t: p.window for t, p in kv.plans.items() if p.window is not None}
        assert windowed

        while r.num_computed_tokens < n:
            r.num_output_placeholders = rng.choice([0, 1, rng.randint(1, min(5, r.num_computed_tokens + 1))])
            at = r.num_computed_tokens - max(0, r.num_output_placeholders - 1)   # the position both calls plan from
            before = {t: (_released(kv, "r", t), len(kv.block_table("r", t))) for t in windowed}
            if at and rng.random() < 0.5:   # the scheduler's release before each step
                kv.release_out_of_window([r])
            else:   # allocate releases within the table it had, then grows it
                chunk = min(rng.randint(1, 12), n - r.num_computed_tokens)
                assert kv.allocate(r, chunk)
                r.num_computed_tokens += chunk
            for t, window in windowed.items():
                was, have = before[t]
                want = max(was, min(_first_kept(ranges, at, window) // kv.block_size, have))
                got = _released(kv, "r", t)
                assert got == want, f"seed {seed}: pool {t} at {at}: {got} released, want {want}"
