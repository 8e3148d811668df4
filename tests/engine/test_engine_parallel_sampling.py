"""n samples of one prompt: each equals a separate request with its derived seed, the prompt's KV is
computed and its frames encoded once, with or without prefix caching (each further sample computes
only the last prompt token again), and every block is free after the run and after a cancel mid-stream."""

from __future__ import annotations

import dataclasses
import random

import pytest
from engine_helpers import PROMPTS, build_request, make_llm

from mmserve.engine.parallel_sampling import fan_out, sample_seed
from mmserve.errors import InvalidInputError

LOOPS = ["off", "on"]   # --async-scheduling: CUDA's default is on; the samples' forks follow their parent either way


def with_sampling(req, **kw):
    return dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, **kw))


def count_prefill_tokens(llm) -> list[int]:
    """Wrap the runner: the prompt tokens each step computes, summed into the returned list's one entry."""
    counted = [0]
    execute = llm.core.runner.execute

    def counting(out, *prev):   # (async scheduling: the step in flight's tokens)
        counted[0] += sum(max(0, min(s.seq_len, s.request.num_prompt_tokens) - s.num_computed_tokens)
                          for s in out.scheduled)
        return execute(out, *prev)

    llm.core.runner.execute = counting
    return counted


@pytest.mark.parametrize("loop", LOOPS)
def test_samples_equal_separate_requests_with_derived_seeds_and_share_the_prompt(load_backend, loop):
    model_tok = load_backend("sdpa")
    seed = random.randrange(2**63)
    req = with_sampling(build_request("p", PROMPTS["video"], random.randrange(10_000), max_tokens=6),
                        temperature=1.0, top_k=20, seed=seed, n=4)
    llm = make_llm(model_tok, attention_backend="sdpa", async_scheduling=loop)
    prefill = count_prefill_tokens(llm)
    got = llm.generate([req])[0]
    assert [s.request_id for s in got.samples] == ["p", "p#1", "p#2", "p#3"]
    alone = make_llm(model_tok, attention_backend="sdpa").generate(
        [with_sampling(dataclasses.replace(req, request_id=f"s{i}"), n=1, seed=sample_seed(seed, i))
         for i in range(4)])
    assert [s.token_ids for s in got.samples] == [a.token_ids for a in alone]
    assert len({tuple(s.token_ids) for s in got.samples}) > 1
    assert llm.core.kv.usage() == 0 and not llm.core.requests and not llm.core.scheduler.forks
    # the prompt once; each further sample computes its last token (its logits) again
    assert prefill[0] == len(req.prompt_token_ids) + 3, prefill[0]


def count_frames_encoded(llm) -> list[int]:
    """Wrap the vision tower: the frames it encodes, summed into the returned list's one entry."""
    counted = [0]
    model = llm.core.model
    encode = model.encode_vision

    def counting(pixel_values, position_ids):
        counted[0] += pixel_values.shape[0]
        return encode(pixel_values, position_ids)

    model.encode_vision = counting
    return counted


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("caching", [False, True])
def test_samples_compute_the_prompt_and_encode_each_frame_once_with_or_without_prefix_caching(load_backend, caching,
                                                                                              loop):
    """Without prefix caching (and so without an encoder cache) the samples used to compute the whole
    prompt and encode every frame again each; now each computes only its last prompt token."""
    model_tok = load_backend("sdpa")
    seed = random.randrange(2**63)
    req = with_sampling(build_request("v", PROMPTS["video"], random.randrange(10_000), max_tokens=5),
                        temperature=1.0, seed=seed, n=4)
    llm = make_llm(model_tok, attention_backend="sdpa", enable_prefix_caching=caching, async_scheduling=loop)
    if not caching:
        assert llm.core.runner.encoder_cache.max_bytes == 0
    prefill, frames = count_prefill_tokens(llm), count_frames_encoded(llm)
    got = llm.generate([req])[0]
    assert prefill[0] == len(req.prompt_token_ids) + 3, prefill[0]
    assert frames[0] == len(req.mm_inputs) == 4
    alone = make_llm(model_tok, attention_backend="sdpa").generate(
        [with_sampling(dataclasses.replace(req, request_id=f"s{i}"), n=1, seed=sample_seed(seed, i))
         for i in range(4)])
    assert [s.token_ids for s in got.samples] == [a.token_ids for a in alone]
    assert llm.core.kv.usage() == 0 and not llm.core.requests and not llm.core.scheduler.forks


@pytest.mark.parametrize("loop", LOOPS)
def test_cancel_mid_stream_frees_every_block(load_backend, loop):
    model_tok = load_backend("sdpa")
    req = with_sampling(build_request("c", PROMPTS["image"], random.randrange(10_000), max_tokens=20),
                        temperature=1.0, n=3)
    llm = make_llm(model_tok, attention_backend="sdpa", async_scheduling=loop)
    core = llm.core
    for sub in fan_out(req):
        llm.add_request(sub)
    for _ in range(4):   # prompt computed, the forks admitted, a few tokens each
        llm.step()
    assert core.kv.usage() > 0 and len(core.scheduler.running) == 3
    assert sorted(rid for sub in fan_out(req) for rid, _ in llm.processor.abort(sub.request_id)) == ["c", "c#1", "c#2"]
    for sub in fan_out(req):
        core.abort(sub.request_id)
    llm.step()
    assert core.kv.usage() == 0 and not core.requests and not core.scheduler.forks and not (core.scheduler.running or core.scheduler.waiting)
    assert not llm.processor.states and not llm.processor.aborting


def test_samples_that_cannot_fit_the_cache_are_refused(load_backend):
    llm = make_llm(load_backend("sdpa"), attention_backend="sdpa", num_kv_blocks=40)
    req = with_sampling(build_request("big", [20], 1, max_tokens=60), n=8)
    with pytest.raises(InvalidInputError) as info:
        llm.core.add_request(req)
    assert info.value.field == "sampling.n" and "--kv-cache-bytes" in str(info.value)


def record_peak_and_preemptions(llm, pool: str) -> tuple[list[int], list[str]]:
    """Wrap the KV manager's allocate and the scheduler's preempt: the most blocks `pool` ever has in
    use (the returned list's one entry), and the ids preempted, in order."""
    kv, scheduler = llm.core.kv, llm.core.scheduler
    peak, preempted = [0], []
    allocate, preempt = kv.allocate, scheduler._preempt

    def allocating(*args):
        ok = allocate(*args)
        peak[0] = max(peak[0], kv.pools[pool].num_usable - kv.pools[pool].num_free)
        return ok

    kv.allocate = allocating
    scheduler._preempt = lambda victim: (preempted.append(victim.request_id), preempt(victim))
    return peak, preempted


@pytest.mark.parametrize("loop", LOOPS)
def test_samples_at_the_kv_bound_run_together_and_one_block_less_is_refused(load_backend, loop):
    """A sample shares its parent's whole blocks before the prompt's last token and copies the block
    holding the rest, its own: for a prompt of whole blocks that is the prompt's last block, which
    the fit check used to count as shared, so it admitted n samples one block short per sample after
    the first, and they preempted one another. At exactly the bound they run together, the pool
    full at their peak; one block less is refused naming sampling.n."""
    model_tok, bs, n = load_backend("sdpa"), 4, 3
    prompt = bs * random.randrange(4, 8)   # whole blocks
    # the last sampled token's K/V is never written, nor the last but one of the samples that join
    # a step later than their parent: lengths ending 1 or 2 tokens into a block never fill it
    max_tokens = random.choice([m for m in range(12, 20) if (prompt + m) % bs not in (1, 2)])
    req = with_sampling(build_request("b", [prompt - 1], random.randrange(10_000), max_tokens=max_tokens),
                        temperature=1.0, seed=random.randrange(2**63), n=n)
    blocks = -(-(prompt + max_tokens) // bs)
    bound = blocks + (n - 1) * (blocks - (prompt - 1) // bs)
    # max_num_batched_tokens 16: the windowed pool's bound (planner.window_pool_blocks) is below the full pool's
    opts = dict(attention_backend="sdpa", max_num_batched_tokens=16, async_scheduling=loop)
    short = make_llm(model_tok, num_kv_blocks=bound, **opts)   # (block 0 is the null block)
    with pytest.raises(InvalidInputError) as info:
        short.core.add_request(req)
    assert info.value.field == "sampling.n" and "pool full_attention" in str(info.value)
    assert "lower n or max_tokens" in str(info.value)
    llm = make_llm(model_tok, num_kv_blocks=bound + 1, **opts)
    peak, preempted = record_peak_and_preemptions(llm, "full_attention")
    got = llm.generate([req])[0]
    assert [len(s.token_ids) for s in got.samples] == [max_tokens] * n
    assert not preempted and peak[0] == bound
    assert llm.core.kv.usage() == 0 and not llm.core.requests
