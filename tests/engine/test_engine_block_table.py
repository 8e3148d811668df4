"""The runner's block tables follow the KV manager's through the deltas alone (growth, sliding
reclamation by allocation and by the per-step release, frees and row reuse), so the runner never reads scheduler internals; its device tables
follow the host's through the changed entries alone (a separate tensor here, as on a GPU)."""

from __future__ import annotations

import random

import torch
from sched_helpers import make_kv, make_request

from mmserve.attention.backend import FULL, SLIDING
from mmserve.core.sched.output import ScheduledRequest
from mmserve.worker.block_table import BlockTables


def test_runner_rows_mirror_the_tables_through_growth_and_reuse():
    rng = random.Random(torch_free_seed())
    kv = make_kv(num_blocks=2000)
    runner = BlockTables([SLIDING, FULL], kv.max_blocks_per_req)
    live, reclaimed = {}, False
    for step in range(300):
        if step > 60 and live and rng.random() < 0.3:
            rid = rng.choice(sorted(live))
            kv.free(rid)
            runner.free(rid)
            del live[rid]
            continue
        # the first 20 steps each admit a request, so the 16-row array must grow (random after: 1 run in 600 never grew)
        rid = step >= 20 and live and rng.random() < 0.6 and rng.choice(sorted(live)) or f"q{step}"
        r = live.setdefault(rid, make_request(rid, 500, max_tokens=1))
        if rng.random() < 0.3:   # the scheduler's per-step release: its changes reach the runner with the next update
            kv.release_out_of_window([r])
        n = rng.randint(1, 12)
        if r.num_computed_tokens + n <= 500 and kv.allocate(r, n):
            for t in (SLIDING, FULL):   # what allocate's no-change bound (_Held.reach) promises
                assert len(kv.block_table(rid, t)) * kv.block_size >= r.num_computed_tokens + n
            s = ScheduledRequest(r, n, r.num_computed_tokens, True, block_updates=kv.take_block_updates(rid))
            (row,) = runner.apply([s])
            r.num_computed_tokens += n
            for t in (SLIDING, FULL):
                table = kv.block_table(rid, t)
                assert runner.rows[t][row, :len(table)].tolist() == table
                assert not runner.rows[t][row, len(table):].any()
                assert runner.dev[t][row].tolist() == runner.rows[t][row].tolist()
            reclaimed |= kv.block_table(rid, SLIDING)[:1] == [0]   # a mirrored row with reclaimed entries
            assert kv.take_block_updates(rid) == {}   # reported once
    assert runner.rows[SLIDING].shape[0] > 16, "the test should have made the row array grow"
    assert reclaimed, "some row mirrored reclaimed sliding entries"
    for t in (SLIDING, FULL):   # every row, live or reused, equal on the device
        assert torch.equal(runner.dev[t], torch.from_numpy(runner.rows[t]))
    for rid in list(live):
        runner.free(rid)
    for t in (SLIDING, FULL):
        assert not runner.rows[t].any() and not runner.dev[t].any()


def torch_free_seed() -> int:
    return random.randrange(2**31)
