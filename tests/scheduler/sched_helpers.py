"""Random requests and model-free stepping for the scheduler tests."""

from __future__ import annotations

import random

from mmserve.attention.backend import FULL, SLIDING, LayerAttentionSpec
from mmserve.core.kv_cache.manager import KVCacheManager
from mmserve.core.kv_cache.planner import plan_pools
from mmserve.core.sched.output import SchedulerOutput
from mmserve.core.sched.scheduler import Scheduler
from mmserve.request import Request
from mmserve.sampling_params import SamplingParams

SPECS = {
    SLIDING: LayerAttentionSpec(SLIDING, 4, 2, 16, window=8, bidirectional=True),
    FULL: LayerAttentionSpec(FULL, 4, 1, 32, window=None, bidirectional=False),
}
LAYER_TYPES = [SLIDING, SLIDING, FULL] * 2


def random_ranges(rng: random.Random, length: int, max_len: int = 12, density: float = 0.2) -> list[tuple[int, int]]:
    """Sorted disjoint inclusive ranges inside [0, length), some of them single tokens."""
    ranges, pos = [], rng.randint(0, 4)
    while pos < length:
        if rng.random() < density:
            end = min(length - 1, pos + rng.randint(0, max_len - 1))
            ranges.append((pos, end))
            pos = end + 1 + rng.randint(1, 3)
        else:
            pos += rng.randint(1, 6)
    return ranges


def make_request(rid: str, prompt_len: int, ranges=(), max_tokens: int = 4, first: int = 3, **kw) -> Request:
    """Prompt tokens first, first + 1, ...: requests made with the same `first` share their prefix
    (a waiting one then waits for the blocks a running one is computing)."""
    return Request(rid, list(range(first, first + prompt_len)), SamplingParams(max_tokens=max_tokens),
                   mm_ranges=list(ranges), **kw)


def make_kv(num_blocks: int, block_size: int = 4, max_model_len: int = 512) -> KVCacheManager:
    return KVCacheManager(plan_pools(LAYER_TYPES, SPECS, block_size=block_size, dtype_bytes=4,
                                     num_kv_blocks=num_blocks).pools, block_size, max_model_len=max_model_len)


def make_scheduler(num_blocks: int = 256, block_size: int = 4, **kw) -> Scheduler:
    opts = dict(max_num_batched_tokens=32, max_num_seqs=8, max_model_len=512)
    opts.update(kw)
    return Scheduler(make_kv(num_blocks, block_size, opts["max_model_len"]), **opts)


def admit(sched: Scheduler, request: Request) -> None:
    """The scheduler's part of admission, as EngineCore.add_request runs it: refuse what can never
    run, then queue (the core's own checks, ids and the waiting limit, need a model: tests/engine)."""
    sched.check_admissible(request)
    sched.enqueue(request)


def samples(s) -> bool:
    """True when a scheduled chunk reaches its request's last token, so a new token is sampled."""
    return s.seq_len - len(s.draft_token_ids) == s.request.num_tokens


def step(sched: Scheduler, on_step=None) -> SchedulerOutput:
    """One step without a model: every sampling chunk 'generates' token 7. `on_step(out)` sees the
    output before the scheduler is updated."""
    out = sched.schedule()
    if on_step:
        on_step(out)
    sched.update(out)
    for s in out.scheduled:
        if samples(s):
            s.request.output_token_ids.append(7)
    return out


def run_to_completion(sched: Scheduler, on_step=None, max_steps: int = 10_000) -> int:
    """Step without a model until every request has its max_tokens. Returns the number of steps."""
    for n in range(max_steps):
        if not (sched.running or sched.waiting):
            return n
        for s in step(sched, on_step).scheduled:   # only a sampled request's output grew
            if len(s.request.output_token_ids) >= s.request.sampling_params.max_tokens:
                sched.finish(s.request.request_id)
    raise AssertionError("scheduler did not drain")
