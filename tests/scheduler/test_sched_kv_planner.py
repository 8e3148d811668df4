"""The KV planner: windowed pools get exactly what the requests that may run at once can hold, the
full-attention pools every other byte, over the Gemma 4 family's real layer shapes and random budgets.
The windowed side is checked against the real scheduler and block manager under random traffic
(frames, prefix caching, speculation's verify chunks and rejections, aborts; the async loop's
order, with a verify chunk's rejections unknown when the next step is scheduled), and its closed
form against a brute-force maximum over every way requests can hold blocks."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sched_helpers import admit, random_ranges

from mmserve.attention.backend import FULL, SLIDING, LayerAttentionSpec
from mmserve.config import EngineConfig
from mmserve.core.kv_cache.block_pool import NULL_BLOCK
from mmserve.core.kv_cache.manager import KVCacheManager
from mmserve.core.kv_cache.planner import KVCacheTooSmall, plan_pools, window_pool_blocks
from mmserve.core.sched.output import DEVICE_DRAFT
from mmserve.core.sched.scheduler import Scheduler
from mmserve.errors import LimitExceededError
from mmserve.model.spec import load_spec
from mmserve.request import Request, RequestStatus
from mmserve.sampling_params import SamplingParams

FAMILY = sorted((Path(__file__).parents[1] / "fixtures" / "gemma4_family").glob("*.json"))
SPECS = {path.stem: load_spec(path) for path in FAMILY}
GiB = 2**30


def plan_for(spec, **kw):
    return plan_pools(spec.kv_layer_types, spec.attention_specs, dtype_bytes=2, **kw)


def full_cost(plan) -> int:
    return sum(p.bytes_per_block for p in plan.pools.values() if p.window is None)


def window_bytes(plan) -> int:
    return sum(p.num_blocks * p.bytes_per_block for p in plan.pools.values() if p.window is not None)


@settings(max_examples=150, deadline=None)
@given(window=st.integers(2, 24), block_size=st.sampled_from([1, 2, 3, 4, 8]), seats=st.integers(1, 3),
       budget=st.integers(1, 14), drafts=st.integers(0, 3))
def test_window_reservation_is_the_most_any_set_of_holds_reaches(window, block_size, seats, budget, drafts):
    """Brute force over every state the scheduler can allocate in: each request holds keys
    [c - K - window + 1, c + max(n, K)) at any alignment, chunks n summing to at most the budget."""
    def blocks(offset: int, n: int) -> int:
        keys = window - 1 + drafts + max(n, drafts)
        return -(-(offset + keys) // block_size) if keys else 0

    def most(requests: int, left: int) -> int:
        if requests == 0:
            return 0
        return max(max(blocks(o, n) for o in range(block_size)) + most(requests - 1, left - n)
                   for n in range(left + 1))

    assert window_pool_blocks(window, block_size=block_size, max_num_seqs=seats, max_step_tokens=budget,
                              num_speculative_tokens=drafts) == 1 + most(seats, budget)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(SPECS)), seats=st.integers(1, 256), budget=st.sampled_from([512, 2048, 8192]),
       drafts=st.sampled_from([0, 3]), gib=st.floats(4, 160), context=st.sampled_from([8192, 32768, 0]))
def test_windowed_pools_get_what_they_can_hold_and_full_pools_the_rest(name, seats, budget, drafts, gib, context):
    spec = SPECS[name]
    max_len = context or spec.max_model_len
    kw = dict(block_size=16, kv_cache_bytes=int(gib * GiB), max_num_seqs=seats, max_step_tokens=budget,
              max_model_len=max_len, num_speculative_tokens=drafts)
    try:
        plan = plan_for(spec, **kw)
    except KVCacheTooSmall as exc:   # refused: then nothing fits one request, and the message says so
        assert f"({max_len} tokens)" in str(exc)
        return
    context_blocks = math.ceil(max_len / 16)
    for p in plan.pools.values():
        if p.window is not None:   # no more than its requests' windows (+ 2K: drafts rejected and in flight,
            # + the null block's and the alignment's 2 per request) and one step's blocks: the reservation's upper bound
            assert p.num_blocks <= plan.max_num_seqs * (math.ceil((p.window + 2 * drafts) / 16) + 2) + math.ceil(budget / 16) + 1
        else:   # every full pool the same blocks: a request needs as many in each
            assert p.num_blocks == next(q.num_blocks for q in plan.pools.values() if q.window is None)
    assert plan.num_bytes + plan.unused_bytes == kw["kv_cache_bytes"]
    assert plan.unused_bytes < full_cost(plan)   # the rest went to full attention
    full = next(p for p in plan.pools.values() if p.window is None)
    assert full.num_blocks - 1 >= context_blocks and plan.full_context_requests(16, max_len) >= 1
    if plan.max_num_seqs < seats:   # fewer seats only when one more would leave no full-context request
        more = plan_for(spec, **{**kw, "num_kv_blocks": 0, "max_num_seqs": plan.max_num_seqs + 1})
        assert more.max_num_seqs == plan.max_num_seqs


def test_12b_at_40_gib_holds_a_million_tokens_of_full_context():
    """The issue's figure: 64 requests with a 2048-token step, the server's window cache share; the old
    split left the full pool 125k tokens."""
    spec = SPECS["12b_unified"]
    plan = plan_for(spec, block_size=16, kv_cache_bytes=40 * GiB, max_num_seqs=64, max_step_tokens=2048,
                    max_model_len=spec.max_model_len, window_cache_share=EngineConfig.window_cache_share)
    assert plan.pool_tokens(16)["full_attention"] >= 1_000_000
    assert plan.max_num_seqs == 64 and plan.full_context_requests(16, spec.max_model_len) == 4


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(SPECS)), share=st.floats(0.01, 1), gib=st.floats(8, 160))
def test_the_window_cache_share_of_what_one_full_context_leaves_keeps_cached_windows(name, share, gib):
    spec = SPECS[name]
    kw = dict(block_size=16, kv_cache_bytes=int(gib * GiB), max_num_seqs=16, max_step_tokens=2048, max_model_len=32768)
    try:
        bare = plan_for(spec, **kw)
    except KVCacheTooSmall:
        return
    plan = plan_for(spec, window_cache_share=share, **kw)
    spare = kw["kv_cache_bytes"] - window_bytes(bare) - (1 + 32768 // 16) * full_cost(bare)
    assert abs(window_bytes(plan) - window_bytes(bare) - share * spare) <= sum(p.bytes_per_block for p in plan.pools.values())
    assert plan.full_context_requests(16, 32768) >= 1 and plan.unused_bytes < full_cost(plan)
    assert plan.max_num_seqs == bare.max_num_seqs


@pytest.mark.parametrize("name", ["12b_unified", "e4b"])
def test_a_cache_too_small_for_one_full_context_request_is_refused_with_the_context_that_fits(name):
    spec = SPECS[name]
    kw = dict(block_size=16, max_num_seqs=8, max_step_tokens=2048, max_model_len=spec.max_model_len)
    with pytest.raises(KVCacheTooSmall) as info:
        plan_for(spec, kv_cache_bytes=2 * GiB, **kw)
    text = str(info.value)
    fits = int(text.rsplit("at most ", 1)[1])
    assert f"({spec.max_model_len} tokens)" in text and "--gpu-memory-utilization" in text and 0 < fits < spec.max_model_len
    plan = plan_for(spec, kv_cache_bytes=2 * GiB, **{**kw, "max_model_len": fits})   # the hint fits ...
    assert plan.full_context_requests(16, fits) >= 1
    with pytest.raises(KVCacheTooSmall):   # ... and is the longest that does
        plan_for(spec, kv_cache_bytes=2 * GiB, **{**kw, "max_model_len": fits + 16})


def _traffic(rng: random.Random, n: int, window: int, budget: int, max_len: int) -> list[Request]:
    out = []
    for i in range(n):
        prompt = rng.randint(1, int(2.5 * window))
        max_tokens = rng.randint(1, min(300, max_len - prompt))
        ranges = random_ranges(rng, prompt, max_len=min(budget, 280), density=rng.choice([0.0, 0.05]))
        shared = rng.random() < 0.3   # some share a prefix: prefix-cache hits and waits for in-flight blocks
        first = 3 if shared else 100 + 1000 * i
        out.append(Request(f"r{i}", list(range(first, first + prompt)), SamplingParams(max_tokens=max_tokens),
                           mm_ranges=ranges))
    return out


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(SPECS)), seats=st.integers(1, 10), budget=st.sampled_from([64, 256, 1024]),
       prefill=st.sampled_from([0, 2048]), drafts=st.sampled_from([0, 1, 3]), caching=st.booleans(),
       spare=st.floats(0, 3), seed=st.integers(0, 2**32))
def test_no_admissible_schedule_runs_a_windowed_pool_dry(name, seats, budget, prefill, drafts, caching, spare, seed):
    """Random traffic through the real scheduler and block manager, with the bytes from the planner:
    the full-attention pool may run short (preemption), a windowed pool never refuses a block."""
    spec = SPECS[name]
    rng = random.Random(seed)
    max_len = 8192
    step_tokens = max(budget, prefill)
    kw = dict(block_size=16, max_num_seqs=seats, max_step_tokens=step_tokens, max_model_len=max_len,
              num_speculative_tokens=drafts)
    one = plan_for(spec, kv_cache_bytes=10**15, **kw)
    windows = window_bytes(one)   # the windows alone, then one full-context request and a random spare
    plan = plan_for(spec, kv_cache_bytes=int(windows + full_cost(one) * (1 + max_len // 16) * (1 + spare)), **kw)
    assert plan.max_num_seqs == seats
    kv = KVCacheManager(plan.pools, 16, max_model_len=max_len, enable_prefix_caching=caching)
    sched = Scheduler(kv, max_num_batched_tokens=budget, prefill_batched_tokens=prefill, max_num_seqs=seats,
                      max_model_len=max_len)
    window = min(p.window for p in plan.pools.values() if p.window is not None)
    pending = _traffic(rng, 2 * seats + 3, window, budget, max_len)
    windowed = [t for t, p in plan.pools.items() if p.window is not None]
    for _ in range(3000):
        if pending and rng.random() < 0.3:
            try:
                admit(sched, pending.pop())
            except LimitExceededError:   # can never run here: not part of an admissible schedule
                pass
        if not (pending or sched.running or sched.waiting):
            break
        for r in sched.running:   # what the drafter leaves a decoding request (capped like Speculator.num_drafts)
            if r.num_computed_tokens >= r.num_prompt_tokens:
                r.draft_token_ids = [7] * max(0, min(drafts, r.sampling_params.max_tokens - len(r.output_token_ids) - 1))
        out = sched.schedule()
        assert not any(kv.refusals[t] for t in windowed), (dict(kv.refusals), name, seats)
        rejected = {}
        for s in out.scheduled:
            if s.seq_len - len(s.draft_token_ids) == s.request.num_tokens:   # it samples: 1 + accepted drafts
                rejected[s.request.request_id] = rng.randint(0, len(s.draft_token_ids))
                s.request.output_token_ids += [7] * (1 + len(s.draft_token_ids) - rejected[s.request.request_id])
        sched.update(out, rejected)
        for s in out.scheduled:
            r = s.request
            if len(r.output_token_ids) >= r.sampling_params.max_tokens or rng.random() < 0.003:   # done, or aborted
                sched.finish(r.request_id)
    assert not any(kv.refusals[t] for t in windowed)


def test_mmserve_perf_prints_the_planners_split(capsys):
    import json

    from mmserve.cli import main

    path = str(FAMILY[[p.stem for p in FAMILY].index("12b_unified")])
    assert main(["perf", "--hf-config", path, "--kv-cache-gib", "40", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["kv_plan"]
    plan = plan_for(SPECS["12b_unified"], block_size=16, kv_cache_bytes=40 * GiB, max_num_seqs=64,
                    max_step_tokens=2048, max_model_len=262144, window_cache_share=EngineConfig.window_cache_share)
    assert {t: p["tokens"] for t, p in got["pools"].items()} == plan.pool_tokens(16)
    assert got["full_context_requests"] == 4 and got["max_num_seqs"] == 64
    assert main(["perf", "--hf-config", path, "--kv-cache-gib", "40", "--request", "1:8192:decode"]) == 0
    text = capsys.readouterr().out
    assert "FLOPs" in text and "4 requests of 262144 tokens fit; 64 run at once" in text
    assert main(["perf", "--hf-config", path, "--kv-cache-gib", "1"]) == 2   # refused, naming the numbers
    assert "cannot hold one request of the full context" in capsys.readouterr().err


def _async_speculating_run(sched: Scheduler, rng: random.Random, pending: list[Request], drafts: int,
                           on_schedule) -> None:
    """The async loop's order without a model (core/async_loop.AsyncLoop._step_async): schedule
    step N+1, then finish step N (its placeholders go, 1 + the drafts the device kept are appended,
    `update` rolls the rest and the pads back), then give N+1's sampled requests the drafts made on
    the device after it. `on_schedule(out, rejectable)` sees each step as scheduled, with the rows per request
    that the step in flight (N) may still reject."""
    in_flight: tuple | None = None
    for _ in range(4000):
        if pending and rng.random() < 0.3:
            try:
                admit(sched, pending.pop())
            except LimitExceededError:
                pass
        if not (pending or sched.running or sched.waiting or in_flight):
            return
        before = {r.request_id: r.num_output_placeholders for r in sched.running + sched.waiting}
        out = sched.schedule()
        on_schedule(out, {rid: max(0, n - 1) for rid, n in before.items()})
        sampled = [s for s in out.scheduled if s.request.num_output_placeholders > before.get(s.request.request_id, 0)]
        if in_flight is not None:
            _finish(sched, rng, *in_flight, drafts)
        for s in sampled:
            if s.request.status == RequestStatus.RUNNING:
                s.request.draft_token_ids = [DEVICE_DRAFT] * drafts
        in_flight = (out, sampled) if out.scheduled else None
    raise AssertionError("the async run did not drain")


def _finish(sched: Scheduler, rng: random.Random, out, sampled: list, drafts: int) -> None:
    rejected, ended = {}, []
    for s in sampled:
        r = s.request
        r.num_output_placeholders -= s.num_sampled_rows + s.num_pad_drafts
        if r.status == RequestStatus.FINISHED:   # aborted while its step ran: its rows are dropped
            continue
        kept = rng.randint(0, len(s.draft_token_ids))
        rejected[r.request_id] = len(s.draft_token_ids) - kept + s.num_pad_drafts
        r.output_token_ids += [7] * (1 + kept)
        ended += [r] if len(r.output_token_ids) >= r.sampling_params.max_tokens or rng.random() < 0.005 else []
    sched.update(out, rejected)
    for r in sched.running + sched.waiting:   # device drafts the step launched did not take: the host's now
        if r.draft_token_ids[:1] == [DEVICE_DRAFT]:
            r.draft_token_ids = [7] * max(0, min(drafts, r.sampling_params.max_tokens - len(r.output_token_ids) - 1))
    for r in ended:
        sched.finish(r.request_id)


def test_the_async_loop_keeps_every_key_its_moved_back_rows_attend_to():
    """Async scheduling with speculation schedules each step, and releases the windows' blocks,
    before the step in flight's rejections are known (its drafts and pads count as computed); the
    device then runs the step lower by as many rows as that one rejects. Every key the step's first
    row attends to at its lowest position is in a held block; every request holds no more blocks
    than the planner budgets one request with its chunk (window_pool_blocks), and no windowed pool
    (the planner's bytes, a full-context request's and a random spare) ever refuses a block. Random
    windows, block sizes, K, budgets and traffic, verify chunks padded to 1 + K; the draws must put
    a block boundary where it matters (a key the window freed from the host's count would lose)."""
    rng = random.Random(random.getrandbits(64))
    at_risk = sum(_async_run_keeps_the_moved_back_windows(rng) for _ in range(12))
    assert at_risk, "no step's moved-back window reached a block the host's count had left behind"


def _async_run_keeps_the_moved_back_windows(rng: random.Random) -> int:
    """One random configuration and traffic of the test above; returns the steps whose first row's
    window, moved back, reached a block before the one the host's count starts its window in."""
    window, bs, k = rng.randint(2, 40), rng.choice([1, 4, 16]), rng.randint(1, 4)
    seats, budget, max_len = rng.randint(1, 6), rng.choice([8, 32, 256]), 1024
    specs = {SLIDING: LayerAttentionSpec(SLIDING, 4, 2, 16, window=window, bidirectional=True),
             FULL: LayerAttentionSpec(FULL, 4, 1, 32, window=None, bidirectional=False)}
    kw = dict(block_size=bs, dtype_bytes=2, max_num_seqs=seats, max_step_tokens=budget, max_model_len=max_len,
              num_speculative_tokens=k)
    one = plan_pools([SLIDING, FULL], specs, kv_cache_bytes=10**15, **kw)
    full = full_cost(one) * (1 + max_len // bs)
    plan = plan_pools([SLIDING, FULL], specs, kv_cache_bytes=int(window_bytes(one) + full * (1 + rng.random())), **kw)
    kv = KVCacheManager(plan.pools, bs, max_model_len=max_len, enable_prefix_caching=rng.random() < 0.5)
    sched = Scheduler(kv, max_num_batched_tokens=budget, prefill_batched_tokens=0, max_num_seqs=seats,
                      max_model_len=max_len, async_scheduling=True, verify_width=1 + k)
    at_risk = 0

    def check(out, rejectable):
        nonlocal at_risk
        assert not kv.refusals[SLIDING], (window, bs, k, seats, budget)
        scheduled = {s.request.request_id: s for s in out.scheduled}
        for r in sched.running:
            s = scheduled.get(r.request_id)
            n = s.num_tokens if s else 0
            held = [b for b in kv.block_table(r.request_id, SLIDING) if b != NULL_BLOCK]
            budgeted = window_pool_blocks(window, block_size=bs, max_num_seqs=1, max_step_tokens=n,
                                          num_speculative_tokens=k) - 1   # (less the null block)
            assert len(held) <= budgeted, (window, bs, k, n, held)
        for s in out.scheduled:
            host = s.num_computed_tokens   # where the host put the chunk; the device: up to `rejectable` lower
            lowest = host - rejectable.get(s.request.request_id, 0)
            first = max(0, lowest - window + 1)
            table = kv.block_table(s.request.request_id, SLIDING)
            lost = [key for key in range(first, lowest + 1) if table[key // bs] == NULL_BLOCK]
            assert not lost, (window, bs, k, host, lowest, lost)
            at_risk += first // bs < max(0, host - window + 1) // bs

    requests = _traffic(rng, 2 * seats + 3, window, budget, max_len)
    for r in requests:
        r.sampling_params = SamplingParams(max_tokens=rng.randint(1, 60))
    _async_speculating_run(sched, rng, requests, k, check)
    return at_risk
