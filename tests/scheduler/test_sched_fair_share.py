"""Fair shares between clients (issue 42 item 7): a client with many requests queued cannot hold
another client's first request back; each client's own requests keep their order; priority still
comes first; preemption takes the request that would be served last."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from sched_helpers import admit, make_request, make_scheduler, run_to_completion, step


def owned(rid: str, owner: bytes, i: int, **kw):
    """A request of `owner`, arriving `i`-th, with a prompt of its own (no prefix shared)."""
    return make_request(rid, 8, first=100 * i + 3, owner=owner, arrival_time=float(i), **kw)


def admission_order(sched) -> list[str]:
    order: list[str] = []
    run_to_completion(sched, lambda out: order.extend(
        s.request.request_id for s in out.scheduled if s.num_computed_tokens == 0))
    return order


def fair_reference(requests, seats: int) -> list[str]:
    """Reference, model-free: each step a free seat goes to the client with the fewest requests
    running (ties: whose oldest waiting request arrived first), its oldest; every running request
    then makes a token (a whole 8-token prompt fits one step's budget) and leaves at max_tokens."""
    waiting = sorted(requests, key=lambda r: r.arrival_time)
    running: dict = {}
    order = []
    while waiting or running:
        while waiting and len(running) < seats:
            load = Counter(r.owner for r in running)
            oldest = {}
            for r in waiting:
                oldest.setdefault(r.owner, r)
            r = min(oldest.values(), key=lambda r: (load[r.owner], r.arrival_time))
            waiting.remove(r)
            running[r] = r.sampling_params.max_tokens
            order.append(r.request_id)
        for r in list(running):
            running[r] -= 1
            if not running[r]:
                del running[r]
    return order


@pytest.mark.parametrize("seed", range(3))
def test_seats_are_shared_between_clients_as_the_reference_shares_them(seed):
    rng = random.Random(seed)
    owners = [bytes([k]) * 4 for k in range(rng.randint(2, 4))]
    who = [o for o in owners for _ in range(rng.randint(1, 7))]
    rng.shuffle(who)
    requests = [owned(f"r{i}", o, i, max_tokens=rng.randint(1, 6)) for i, o in enumerate(who)]
    sched = make_scheduler(max_num_seqs=3)
    for r in requests:
        admit(sched, r)
    order = admission_order(sched)
    assert order == fair_reference(requests, seats=3)
    for o in owners:   # and each client's own requests in arrival order
        mine = [r.request_id for r in requests if r.owner == o]
        assert [rid for rid in order if rid in mine] == mine


def test_a_bystanders_first_request_takes_the_next_free_seat():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(6):
        admit(sched, owned(f"flood{i}", b"flood", i, max_tokens=3 + i))
    step(sched)   # flood0 and flood1 run; flood2..5 wait
    admit(sched, owned("bystander", b"other", 6, max_tokens=2))
    order = admission_order(sched)
    assert order[0] == "bystander"   # flood0 ends first: its seat goes to the bystander, not flood2
    assert [r for r in order if r.startswith("flood")] == ["flood2", "flood3", "flood4", "flood5"]   # FCFS


def test_priority_comes_before_fairness():
    sched = make_scheduler(max_num_seqs=2, policy="priority")
    for i in range(4):
        admit(sched, owned(f"a{i}", b"a", i, priority=1))
    admit(sched, owned("b_low", b"b", 4, priority=0))
    admit(sched, owned("b_high", b"b", 5, priority=1))
    # priority 1 first, shared between the clients; b's low-priority request last though b runs fewer
    assert admission_order(sched) == ["a0", "b_high", "a1", "a2", "a3", "b_low"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_takes_the_request_served_last(policy):
    # 16 usable blocks of 4 tokens; four requests growing to 28 tokens (7 blocks) each cannot all stay.
    sched = make_scheduler(num_blocks=17, block_size=4, max_num_batched_tokens=64, max_num_seqs=4, policy=policy)
    for i in range(3):
        admit(sched, owned(f"a{i}", b"a", i, max_tokens=20))
    admit(sched, owned("b", b"b", 3, max_tokens=20))   # admitted last, but its client runs one, a runs three
    preempted: list[str] = []
    run_to_completion(sched, lambda out: preempted.extend(out.preempted_ids))
    assert preempted[:2] == ["a2", "a1"]   # a's latest while a runs more than b (FCFS alone: b first)
