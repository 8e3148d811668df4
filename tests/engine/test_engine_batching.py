"""(d) 64 concurrent requests equal each run alone; (e) preemption keeps outputs; (f) sliding-layer
blocks stay bounded by the window; every block comes back."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from engine_helpers import build_request, greedy_agree, make_llm, record_decisions

from mmserve.attention.backend import FULL, SLIDING
from mmserve.config import EngineConfig
from mmserve.engine.async_engine import AsyncEngine
from mmserve.errors import LimitExceededError
from mmserve.metrics.perf_model import PerfModel
from mmserve.metrics.prometheus import EngineMetrics
from mmserve.metrics.telemetry import TelemetryObserver


def random_requests(n: int, seed: int, max_tokens=(1, 8), penalties: bool = False):
    """`penalties`: about half the requests (greedy) also ask for repetition/frequency/presence penalties."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        parts = [rng.randint(1, 30)]
        if rng.random() < 0.5:
            parts.append(("video" if rng.random() < 0.7 else "image",
                          [rng.choice([1, 2, 4, 8]) for _ in range(rng.randint(1, 4))]))
            parts.append(rng.randint(0, 10))
        kw = {}
        if penalties and rng.random() < 0.6:
            kw = dict(repetition_penalty=rng.uniform(1.5, 3.0), frequency_penalty=rng.uniform(0.5, 2.0),
                      presence_penalty=rng.uniform(0.5, 2.0))
        reqs.append(build_request(f"r{i}", parts, seed * 1000 + i, max_tokens=rng.randint(*max_tokens), **kw))
    return reqs


def alone(model_tok, reqs, **options):
    """Each request's greedy tokens run alone, and the logits rows they were chosen from."""
    llm = make_llm(model_tok, **options)
    decisions = record_decisions(llm)
    return {r.request_id: llm.generate([r])[0].token_ids for r in reqs}, decisions


def assert_same_greedy_tokens(got: dict, expected: dict, decisions: dict) -> None:
    """Every request's tokens are those it gives alone, up to a near tie of its own (engine_helpers.greedy_agree)."""
    assert got.keys() == expected.keys()
    for rid, want in expected.items():
        greedy_agree(want, got[rid], decisions[rid])


def assert_pools_full(core):
    """Nothing in flight holds anything: every block free (empty or cached), the encoder cache in its bound."""
    assert all(p.num_free == p.num_usable and not any(p.ref_cnt) for p in core.kv.pools.values())
    cache = core.runner.encoder_cache
    assert cache.num_bytes <= cache.max_bytes
    assert not core.sampler.penalties._slot and not core.requests


def test_64_concurrent_requests_match_running_alone(load_backend):
    model_tok = load_backend("reference")
    reqs = random_requests(64, seed=int(torch.randint(0, 1000, ())))
    expected, decisions = alone(model_tok, reqs)
    model, tok = model_tok
    config = EngineConfig(device="cpu", block_size=4, num_kv_blocks=1024, max_num_seqs=64,
                          max_num_batched_tokens=128)
    engine = AsyncEngine(config, model=model, tokenizer=tok)

    async def main():
        await engine.start()

        async def one(r):
            outs = [o async for o in engine.generate(r)]
            assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
            assert outs[-1].usage.completion_tokens == r.sampling.max_tokens
            return r.request_id, [t for o in outs for t in o.new_token_ids]

        try:
            got = dict(await asyncio.gather(*(one(r) for r in reqs)))
            peak = engine.load()
        finally:
            await engine.shutdown()
        return got, peak

    got, load = asyncio.run(main())
    assert_same_greedy_tokens(got, expected, decisions)
    assert_pools_full(engine.core)
    assert load.kv_usage == 0.0 and load.running == 0


class _Preemptions(TelemetryObserver):
    """Counts preemptions; after each step, the penalty slots held beside the requests running. The
    telemetry it is keeps the prefix-cache counters."""

    def __init__(self, core, model):
        super().__init__(PerfModel(model.spec, dtype="float32"), metrics=EngineMetrics(prometheus=True),
                         step_trace_ratio=0)
        self.core, self.count, self.slots = core, 0, []

    def on_step(self, record):
        super().on_step(record)
        self.count += record.num_preempted
        self.slots.append((len(self.core.sampler.penalties._slot), len(self.core.scheduler.running)))


@pytest.mark.parametrize("loop", ["off", "on"])
def test_preemption_under_a_tiny_cache_keeps_outputs(load_backend, loop):
    """Preempted requests (some with penalties, whose counts and prompt bitmask are rebuilt when they
    resume) give the tokens they give alone; a preempted request holds no penalty slot, so slots
    never outnumber the running requests (the tables have --max-num-seqs rows). Async: a request
    is preempted while a step that scheduled it is in flight. The prefix-cache counters count each
    prompt's lookup once, as vLLM's do: a return from preemption (which re-finds its own blocks) is
    not a query (they counted 229 tokens for 179 of prompts)."""
    model_tok = load_backend("reference")
    reqs = random_requests(10, seed=int(torch.randint(0, 1000, ())), max_tokens=(6, 10), penalties=True)
    expected, decisions = alone(model_tok, reqs)
    # 25 usable blocks of 4 tokens: the longest request fits alone, ten together do not.
    llm = make_llm(model_tok, num_kv_blocks=26, max_num_seqs=10, max_num_batched_tokens=32, async_scheduling=loop)
    llm.observer = observer = _Preemptions(llm.core, model_tok[0])
    got = {c.request_id: c.token_ids for c in llm.generate(reqs)}
    assert observer.count > 0, "the cache should have been too small to avoid preemption"
    registry = observer.metrics.registry
    assert registry.get_sample_value("mmserve_prefix_cache_queries_total") == sum(len(r.prompt_token_ids) for r in reqs)
    assert_same_greedy_tokens(got, expected, decisions)
    assert all(slots <= running for slots, running in observer.slots), observer.slots
    assert_pools_full(llm.core)


def test_sliding_layer_blocks_stay_bounded_by_the_window(load_backend):
    model_tok = load_backend("reference")
    model, _ = model_tok
    window = model.spec.attention_specs[SLIDING].window
    req = build_request("long", [30, ("video", [8] * 20), 40], seed=3, max_tokens=20)
    budget, bs = 16, 4
    llm = make_llm(model_tok, max_num_batched_tokens=budget, num_kv_blocks=256)
    held = {SLIDING: [], FULL: []}

    cached = []

    execute = llm.core.runner.execute

    def watched(out, *prev):   # the KV held while the step runs (the request's end frees it before the observer runs)
        result = execute(out, *prev)
        for t in held:
            held[t].append(llm.core.kv.num_held("long", t))
        cached.append(result.frames_encoded.get("long", 0))
        return result

    llm.core.runner.execute = watched
    out = llm.generate([req])[0]
    total = len(req.prompt_token_ids) + len(out.token_ids) - 1
    assert total > 10 * window
    assert max(held[FULL]) == -(-total // bs)              # full layers keep everything
    assert max(held[SLIDING]) <= (window + budget) // bs + 2  # sliding layers: window + one chunk
    assert held[SLIDING][-1] <= window // bs + 2              # decoding: just the window
    # every frame is encoded exactly once, in the step its tokens enter
    assert sum(cached) == 20
    assert_pools_full(llm.core)


def test_waiting_queue_is_bounded_and_retryable(load_backend):
    """The core's admission (the one path every door takes) bounds the waiting queue: the next
    request is refused with a retryable error, which a client may try again later."""
    llm = make_llm(load_backend("reference"), max_waiting_requests=3)
    for i in range(3):
        llm.core.add_request(build_request(f"r{i}", [5], seed=i).core_request())
    with pytest.raises(LimitExceededError, match="--max-waiting-requests") as e:
        llm.core.add_request(build_request("r3", [5], seed=3).core_request())
    assert e.value.retryable
