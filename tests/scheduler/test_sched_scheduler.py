"""Scheduler policy: budgets, frame-aligned chunking, admission errors, preemption, priority."""

from __future__ import annotations

import random

import pytest
from sched_helpers import admit, make_request, make_scheduler, random_ranges, run_to_completion, step

from mmserve.core.sched.chunks import align_chunk
from mmserve.errors import LimitExceededError
from mmserve.request import RequestStatus


def test_align_chunk_moves_boundary_before_the_frame():
    import numpy as np
    ranges = np.array([[5, 9], [12, 12]])
    assert align_chunk(ranges, 0, 7) == 5      # would end at 6, inside [5, 9]
    assert align_chunk(ranges, 0, 10) == 10    # ends exactly at 9
    assert align_chunk(ranges, 5, 3) == 0      # starts at the frame and cannot hold it
    assert align_chunk(ranges, 0, 13) == 13    # a single-token range is never cut


@pytest.mark.parametrize("seed", range(4))
def test_budget_and_chunks_never_split_a_frame(seed):
    rng = random.Random(seed)
    budget = rng.choice([16, 24, 32])
    sched = make_scheduler(max_num_batched_tokens=budget, max_num_seqs=5, num_blocks=64)
    reqs = []
    for i in range(12):
        n = rng.randint(1, 90)
        r = make_request(f"r{i}", n, random_ranges(rng, n, max_len=budget), max_tokens=rng.randint(1, 5))
        admit(sched, r)
        reqs.append(r)
    seen_tokens = {r.request_id: 0 for r in reqs}

    def check(out):
        assert out.num_batched_tokens <= budget
        assert len(sched.running) <= 5
        for s in out.scheduled:
            assert s.num_computed_tokens == s.request.num_computed_tokens
            end = s.num_computed_tokens + s.num_tokens - 1
            for a, b in s.request.mm_ranges:
                assert not a <= end < b, f"chunk ends at {end} inside {(a, b)}"
            for f in s.frames:   # every frame to encode lies wholly inside this chunk
                a, b = s.request.mm_ranges[f]
                assert s.num_computed_tokens <= a and b <= end
            seen_tokens[s.request.request_id] += s.num_tokens + (s.num_cached_tokens or 0)

    run_to_completion(sched, check)
    for r in reqs:
        assert r.status == RequestStatus.FINISHED
        assert len(r.output_token_ids) == r.sampling_params.max_tokens
        # every prompt token and every generated token but the last entered the model or came from
        # the prefix cache (the prompts share their first tokens), plus recomputes
        assert seen_tokens[r.request_id] >= r.num_tokens - 1
    assert all(p.num_free == p.num_usable for p in sched.kv.pools.values())


def test_frame_longer_than_budget_is_an_admission_error():
    sched = make_scheduler(max_num_batched_tokens=16)
    with pytest.raises(LimitExceededError, match="--max-num-batched-tokens") as e:
        admit(sched, make_request("big", 40, [(3, 19)]))
    assert not e.value.retryable
    assert not (sched.running or sched.waiting)


def test_context_and_kv_limits_are_admission_errors():
    sched = make_scheduler(max_model_len=64)
    with pytest.raises(LimitExceededError, match="--max-model-len") as too_long:
        admit(sched, make_request("long", 60, max_tokens=8))
    tiny = make_scheduler(num_blocks=4, block_size=4)
    with pytest.raises(LimitExceededError, match="--kv-cache-bytes") as too_fat:
        admit(tiny, make_request("fat", 40))
    assert not too_long.value.retryable and not too_fat.value.retryable


def test_preemption_frees_and_recomputes():
    # 3 requests of 40 tokens need 10 blocks each in the full pool; 16 usable blocks fit one and a half.
    sched = make_scheduler(num_blocks=17, block_size=4, max_num_batched_tokens=64)
    reqs = [make_request(f"r{i}", 30, [(4, 9)], max_tokens=10) for i in range(3)]
    for r in reqs:
        admit(sched, r)
    preempted = []
    run_to_completion(sched, lambda out: preempted.extend(out.preempted_ids))
    assert preempted, "the tiny cache should force a preemption"
    assert all(len(r.output_token_ids) == 10 for r in reqs)
    assert all(p.num_free == p.num_usable for p in sched.kv.pools.values())


def test_priority_policy_admits_highest_value_first():
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    for rid, prio in [("late", -5), ("urgent", 1), ("normal", 0), ("normal2", 0)]:
        admit(sched, make_request(rid, 4, priority=prio))
    order = []
    run_to_completion(sched, lambda out: order.extend(
        s.request.request_id for s in out.scheduled if s.num_computed_tokens == 0))
    assert order == ["urgent", "normal", "normal2", "late"]  # equal priorities stay FCFS


def test_priority_policy_preempts_the_lowest_priority_latest_arrival():
    # 16 usable blocks of 4 tokens; three requests growing to 28 tokens (7 blocks) each cannot all stay.
    sched = make_scheduler(num_blocks=17, block_size=4, max_num_batched_tokens=64, max_num_seqs=3, policy="priority")
    for rid in ("low1", "low2"):
        admit(sched, make_request(rid, 8, max_tokens=20, priority=-1))
    preempted: list[str] = []
    step(sched)                               # both low requests run before the urgent one arrives
    admit(sched, make_request("high", 8, max_tokens=20, priority=5))   # admitted last
    run_to_completion(sched, lambda out: preempted.extend(out.preempted_ids))
    assert preempted and preempted[0] == "low2"
    assert "high" not in preempted


def test_finish_of_waiting_request_and_unknown_id():
    sched = make_scheduler()
    admit(sched, make_request("a", 4))
    assert sched.finish("a") is not None
    assert sched.finish("a") is None
    assert sched.schedule().finished_ids == ["a"]


def test_a_frame_blocked_by_decodes_is_not_starved():
    # Seven decoders take 7 of 16 tokens every step; a 14-token frame needs a step of its own.
    sched = make_scheduler(max_num_batched_tokens=16, max_num_seqs=8)
    for i in range(7):
        admit(sched, make_request(f"d{i}", 2, max_tokens=200))
    while any(r.is_prefill for r in sched.running) or sched.waiting:
        step(sched)
    frame = make_request("f", 20, [(3, 16)], max_tokens=1)
    admit(sched, frame)
    steps = 0
    while frame.num_computed_tokens <= 16 and steps < 4:
        steps += 1
        assert step(sched).num_batched_tokens <= 16
    assert frame.num_computed_tokens > 16, "the frame never got a step"
    assert steps <= 3   # one step for the text before it, one skipped, then the frame first


@pytest.mark.parametrize("seed", range(4))
def test_a_step_carrying_a_decode_stays_within_the_base_budget(seed):
    """The larger prefill budget is spent only while nobody decodes, so no decode waits on a long step."""
    rng = random.Random(seed)
    sched = make_scheduler(max_num_batched_tokens=16, prefill_batched_tokens=96, max_num_seqs=6, num_blocks=512)
    for i in range(10):
        n = rng.randint(5, 70)
        admit(sched, make_request(f"r{i}", n, random_ranges(rng, n, max_len=8), max_tokens=rng.randint(1, 8)))
    sizes = []

    def check(out):
        decodes = [s for s in out.scheduled if not s.is_prefill]
        assert out.num_batched_tokens <= (16 if decodes else 96)
        sizes.append(out.num_batched_tokens)
    run_to_completion(sched, check)
    assert max(sizes) > 16   # the prefill-only steps did use the larger budget


def test_prefill_budget_shrinks_once_the_first_request_decodes():
    sched = make_scheduler(max_num_batched_tokens=16, prefill_batched_tokens=64)
    for i in range(3):   # prompts that share no block, so nobody waits for another's prefix
        admit(sched, make_request(f"r{i}", 30, max_tokens=4, first=3 + 100 * i))
    assert step(sched).num_batched_tokens == 64      # 30 + 30 + 4, nobody decodes yet
    out = step(sched)                                 # r0 and r1 now decode
    assert out.num_batched_tokens == 16 and sum(not s.is_prefill for s in out.scheduled) == 2


def test_speculating_chunks_are_padded_to_the_verify_width_and_pads_go_first():
    """With verify graphs (verify_width 1 + K = 4) every speculating decode is a 4-row chunk whatever
    its drafts (3, 1, none: near max_tokens or cut by a grammar); a disable_speculation request stays
    one row. Pads are rolled back like rejected drafts, and go before drafts when the budget, the KV
    cache or the context length is short."""
    from mmserve.sampling_params import SamplingParams

    def decoding(sched, specs, max_tokens=20):
        reqs = []
        for i, (drafts, opt_out) in enumerate(specs):
            r = make_request(f"r{i}", 6, first=3 + 50 * i)
            r.sampling_params = SamplingParams(max_tokens=max_tokens, disable_speculation=opt_out)
            admit(sched, r)
            reqs.append((r, drafts))
        step(sched)                                  # prompts computed, one token each
        for r, drafts in reqs:
            r.draft_token_ids = list(range(30, 30 + drafts))
        return [r for r, _ in reqs]

    sched = make_scheduler(max_num_batched_tokens=64, verify_width=4)
    reqs = decoding(sched, [(3, False), (1, False), (0, False), (0, True)])
    out = sched.schedule()
    got = {s.request.request_id: (s.num_tokens, len(s.draft_token_ids), s.num_pad_drafts) for s in out.scheduled}
    assert got == {"r0": (4, 3, 0), "r1": (4, 1, 2), "r2": (4, 0, 3), "r3": (1, 0, 0)}
    before = {r.request_id: r.num_computed_tokens for r in reqs}
    # r0 and r1 kept their first draft and the target's next token, r2 and r3 one token: appended
    # first (as the engine does), then the rest of each chunk (rejected drafts, pads) rolls back
    for r, n in zip(reqs, (2, 2, 1, 1), strict=True):
        r.output_token_ids += [7] * n
    sched.update(out, {"r0": 2, "r1": 2, "r2": 3, "r3": 0})
    assert {r.request_id: r.num_computed_tokens - before[r.request_id] for r in reqs} == {
        "r0": 2, "r1": 2, "r2": 1, "r3": 1}

    # budget: 4 + 4 fit, the third request's chunk keeps its drafts and no pads (a partial width buys nothing)
    sched = make_scheduler(max_num_batched_tokens=10, prefill_batched_tokens=64, verify_width=4)
    decoding(sched, [(3, False), (0, False), (1, False)])
    assert [(s.num_tokens, s.num_pad_drafts) for s in sched.schedule().scheduled] == [(4, 0), (4, 3), (2, 0)]

    # KV: pools of 2 blocks hold its 6 + 2 tokens (what admission counted) but not 2 pads past them
    sched = make_scheduler(num_blocks=3, max_num_batched_tokens=64, verify_width=4)
    decoding(sched, [(1, False)], max_tokens=2)
    (s,) = sched.schedule().scheduled
    assert (s.num_tokens, len(s.draft_token_ids), s.num_pad_drafts) == (2, 1, 0)

    # the context length: no pad position past max_model_len
    sched = make_scheduler(max_num_batched_tokens=64, verify_width=4, max_model_len=8)
    decoding(sched, [(0, False)], max_tokens=2)
    (s,) = sched.schedule().scheduled
    assert (s.num_tokens, s.num_pad_drafts) == (1, 0)


def test_frames_added_to_an_open_prompt_are_never_split():
    """A live session's context grows by `extend_prompt`; a frame it adds is kept whole by chunking
    like one in the first prompt (its range indexed again with the prompt)."""
    sched = make_scheduler(max_num_batched_tokens=16)
    live = make_request("live", 4, open_prompt=1000)
    admit(sched, live)
    step(sched)
    assert live.num_computed_tokens == 4
    frame = (5, 20)   # a 16-token frame after one text token: a 16-token chunk from 4 would end inside it
    live.extend_prompt(list(range(100, 125)), [frame], [])
    chunks = []
    while live.num_computed_tokens < live.num_prompt_tokens:
        chunks += [(s.num_computed_tokens, s.num_tokens) for s in step(sched).scheduled]
    assert all(not frame[0] <= start + n - 1 < frame[1] for start, n in chunks), chunks
    assert (frame[0], frame[1] - frame[0] + 1) in chunks, chunks   # the frame in one chunk of its own
