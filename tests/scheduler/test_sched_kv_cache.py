"""KV block pools: sizing, all-or-nothing allocation, sliding-window reclamation, freeing."""

from __future__ import annotations

from sched_helpers import LAYER_TYPES, SPECS, admit, make_kv, make_request

from mmserve.attention.backend import FULL, SLIDING
from mmserve.core.kv_cache.manager import NULL_BLOCK
from mmserve.core.kv_cache.planner import plan_pools


def test_pools_sized_from_bytes_get_equal_block_counts():
    # sliding: 4 layers * 2 * bs4 * 2 heads * 16 * 4 B = 4096 B; full: 2 * 2 * 4 * 1 * 32 * 4 = 2048 B
    plans = plan_pools(LAYER_TYPES, SPECS, block_size=4, dtype_bytes=4, kv_cache_bytes=6144 * 10 + 100)
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


def test_windowed_pool_is_capped_and_its_bytes_go_to_the_full_pool():
    import random

    from sched_helpers import random_ranges, run_to_completion

    from mmserve.core.kv_cache.manager import KVCacheManager
    from mmserve.core.sched.scheduler import Scheduler

    per_block = {SLIDING: 4 * 2 * 4 * 2 * 16 * 4, FULL: 2 * 2 * 4 * 1 * 32 * 4}
    budget = 400 * sum(per_block.values())
    plans = plan_pools(LAYER_TYPES, SPECS, block_size=4, dtype_bytes=4, kv_cache_bytes=budget,
                       max_num_seqs=4, max_chunk=32)
    cap = 4 * (-(-(8 + 32) // 4) + 1) + 1
    assert plans[SLIDING].num_blocks == cap < 400 < plans[FULL].num_blocks
    assert sum(p.num_blocks * per_block[t] for t, p in plans.items()) <= budget
    # four requests at a time with full-budget chunks never run the capped pool dry
    sched = Scheduler(KVCacheManager(plans, 4, max_model_len=512), max_num_batched_tokens=32, max_num_seqs=4,
                      max_model_len=512)
    rng = random.Random(1)
    for i in range(12):
        admit(sched, make_request(f"r{i}", 150, random_ranges(rng, 150, max_len=10), max_tokens=20))
    preempted = []
    run_to_completion(sched, lambda out: preempted.extend(out.preempted_ids))
    assert preempted == []
    assert all(p.num_free == p.num_usable for p in sched.kv.pools.values())
