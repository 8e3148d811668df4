"""Logprobs against transformers: each sampled token's logprob, rank and top alternatives equal
log_softmax of transformers' logits over the same sequence, for greedy and for adjusted sampling
(logprobs describe the model, before penalties, bias and temperature)."""

from __future__ import annotations

import dataclasses

import torch
from engine_helpers import (
    PROMPTS,
    assert_rank_close,
    assert_top_ids_close,
    build_request,
    hf_logits,
    make_llm,
)


def with_sampling(req, **kw):
    return dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, **kw))


def test_logprobs_equal_log_softmax_of_transformers_logits(load_backend, engine_checkpoint):
    model_tok = load_backend("sdpa")
    _, hf = engine_checkpoint
    seeds = torch.randint(0, 10_000, (3,)).tolist()
    greedy_text = build_request("text", PROMPTS["text"], seeds[0], max_tokens=8, logprobs=True, top_logprobs=5)
    greedy_video = build_request("video", PROMPTS["video"], seeds[1], max_tokens=8, logprobs=True, top_logprobs=3)
    adjusted = with_sampling(build_request("adjusted", PROMPTS["image"], seeds[2], max_tokens=8),
                             logprobs=True, top_logprobs=4, temperature=0.9, seed=seeds[2], repetition_penalty=1.4,
                             presence_penalty=0.5, logit_bias=((20, 3.0),))
    plain = build_request("plain", PROMPTS["text"], seeds[0], max_tokens=8)   # shares the batch, asks nothing
    results = make_llm(model_tok, attention_backend="sdpa").generate([greedy_text, greedy_video, adjusted, plain])
    assert results[3].logprobs is None
    for req, got in zip([greedy_text, greedy_video, adjusted], results, strict=False):
        assert len(got.logprobs) == len(got.token_ids) == 8
        # transformers turns every placeholder id in its input into a vision slot, so a sampled
        # placeholder (we embed it as text, as vLLM does) ends what it can be compared with
        upto = text_prefix(hf.config, got.token_ids)
        ref = torch.log_softmax(hf_logits(hf, req, got.token_ids[:upto]).float(), dim=-1)
        n = len(req.prompt_token_ids)
        compared = min(upto + 1, len(got.token_ids))
        for i, (token, lp) in enumerate(zip(got.token_ids[:compared], got.logprobs[:compared], strict=True)):
            row = ref[n - 1 + i]
            assert lp.token_id == token
            assert abs(lp.logprob - row[token].item()) < 1e-4, (req.request_id, i)
            # rank and top ids as transformers', save entries it holds within a near tie (either order)
            assert_rank_close(lp.rank, token, row)
            top = torch.topk(row, req.sampling.top_logprobs)
            assert_top_ids_close(lp.top_ids, row, req.sampling.top_logprobs)
            assert torch.allclose(torch.tensor(lp.top_logprobs), top.values, atol=1e-4)
            if req.sampling.greedy:
                assert lp.rank == 1 and lp.top_ids[0] == token


def text_prefix(cfg, token_ids: list[int]) -> int:
    """How many leading generated ids are not placeholders (transformers can take them as text)."""
    placeholders = {cfg.image_token_id, cfg.video_token_id, cfg.audio_token_id}
    return next((i for i, t in enumerate(token_ids) if t in placeholders), len(token_ids))


def test_logprobs_alone_do_not_change_the_sampled_tokens(load_backend):
    model_tok = load_backend("sdpa")
    req = with_sampling(build_request("r", PROMPTS["text"], 5, max_tokens=6), temperature=1.0, seed=77)
    with_lp = with_sampling(req, logprobs=True, top_logprobs=2)
    a, b = make_llm(model_tok, attention_backend="sdpa").generate([req, dataclasses.replace(with_lp, request_id="q")])
    assert a.token_ids == b.token_ids and len(b.logprobs) == 6


def test_prompt_logprobs_over_chunks_equal_transformers(load_backend, engine_checkpoint):
    model_tok = load_backend("sdpa")
    _, hf = engine_checkpoint
    req = with_sampling(build_request("p", PROMPTS["video"], int(torch.randint(0, 10_000, ())), max_tokens=2),
                        prompt_logprobs=True, top_logprobs=2)
    got = make_llm(model_tok, attention_backend="sdpa", max_num_batched_tokens=16).generate([req])[0]
    ref = torch.log_softmax(hf_logits(hf, req).float(), dim=-1)
    ids = req.prompt_token_ids
    assert len(got.prompt_logprobs) == len(ids) - 1 and got.logprobs is None
    for j, lp in enumerate(got.prompt_logprobs):
        assert lp.token_id == ids[j + 1]
        assert abs(lp.logprob - ref[j, ids[j + 1]].item()) < 1e-4, j
        assert_top_ids_close(lp.top_ids, ref[j], 2)


def test_prompt_logprobs_are_whole_when_the_prompt_was_seen_before(load_backend):
    """A prefix-cache hit would skip prompt tokens; a prompt_logprobs request must never read the cache."""
    req = with_sampling(build_request("a", PROMPTS["text"], int(torch.randint(0, 10_000, ())), max_tokens=2),
                        prompt_logprobs=True)
    llm = make_llm(load_backend("sdpa"), attention_backend="sdpa")
    first = llm.generate([req])[0]
    again = llm.generate([dataclasses.replace(req, request_id="b")])[0]   # its prompt may be cached now
    assert len(again.prompt_logprobs) == len(req.prompt_token_ids) - 1
    assert torch.allclose(torch.tensor([lp.logprob for lp in again.prompt_logprobs]),
                          torch.tensor([lp.logprob for lp in first.prompt_logprobs]), atol=1e-5)
