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
