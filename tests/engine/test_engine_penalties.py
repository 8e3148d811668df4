"""Penalties, logit bias and min_tokens: the batched adjustments against a plain per-row reference
written here on random logits and token histories; min_tokens and logit_bias end to end."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from engine_helpers import PROMPTS, build_request, make_llm

from mmserve.errors import InvalidInputError
from mmserve.request import Request
from mmserve.sample.penalties import Adjustments, PenaltyState
from mmserve.sample.row_values import RowValues
from mmserve.sampling_params import SamplingParams
from mmserve.spec_decode.verify import VerifyRow


def adjust(logits: torch.Tensor, rows, eos, state: PenaltyState) -> None:
    """In place: the sampler's adjustments of `rows` (Requests or verify rows), planned and applied."""
    values = RowValues()
    adjustments = Adjustments(values, rows, [r.sampling_params for r in rows], eos, state, logits.shape[1])
    adjustments.apply(logits, values.to(logits.device))


def reference(logits: torch.Tensor, params, prompts, outputs, eos) -> torch.Tensor:
    """vLLM's documented semantics, one row and one token at a time."""
    out = logits.clone()
    for r, p in enumerate(params):
        row = out[r]
        for t, b in p.logit_bias:
            row[t] += b
        if len(outputs[r]) < p.min_tokens:
            for t in eos:
                row[t] = float("-inf")
        for t in range(row.shape[0]):
            count = outputs[r].count(t)
            if p.repetition_penalty != 1.0 and (count or t in prompts[r]):
                row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
            row[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


def test_batched_adjustments_equal_the_per_row_reference():
    rng = random.Random(random.getrandbits(64))
    vocab, eos = 64, [1, 5]
    params, prompts, outputs = [], [], []
    for _ in range(12):
        use = rng.random
        params.append(SamplingParams(
            max_tokens=30,
            repetition_penalty=rng.uniform(0.5, 2.0) if use() < 0.6 else 1.0,
            frequency_penalty=rng.uniform(-2, 2) if use() < 0.6 else 0.0,
            presence_penalty=rng.uniform(-2, 2) if use() < 0.6 else 0.0,
            min_tokens=rng.randrange(0, 12) if use() < 0.5 else 0,
            logit_bias=tuple((rng.randrange(vocab), rng.uniform(-100, 100)) for _ in range(rng.randrange(0, 5)))))
        prompts.append([rng.randrange(vocab) for _ in range(rng.randrange(1, 40))])
        outputs.append([rng.randrange(vocab) for _ in range(rng.randrange(0, 20))])
    logits = torch.randn(12, vocab) * 5
    got = logits.clone()
    requests = [Request(f"r{i}", prompt, p, output_token_ids=list(output))
                for i, (prompt, p, output) in enumerate(zip(prompts, params, outputs, strict=True))]
    adjust(got, requests, eos, PenaltyState(capacity=64))
    want = reference(logits, params, prompts, outputs, eos)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.allclose(got[torch.isfinite(want)], want[torch.isfinite(want)], atol=1e-4)


def test_penalty_state_kept_across_steps_equals_the_reference_each_step():
    """The per-request device state grows with each step's new output tokens (verify rows' drafts
    counted on a copy only): every step's penalised logits equal the reference on the full history."""
    rng = random.Random(random.getrandbits(64))
    vocab = 48
    params = [SamplingParams(repetition_penalty=rng.uniform(1.1, 2.0), frequency_penalty=rng.uniform(-1, 1),
                             presence_penalty=rng.uniform(-1, 1)) for _ in range(3)]
    requests = [Request(f"r{i}", [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))], p)
                for i, p in enumerate(params)]
    state = PenaltyState(capacity=64)
    for _ in range(6):
        drafts = tuple(rng.randrange(vocab) for _ in range(rng.randrange(0, 3)))
        rows = [requests[0], VerifyRow(requests[1], drafts), requests[2]]
        logits = torch.randn(3, vocab) * 4
        got = logits.clone()
        adjust(got, rows, [], state)
        want = reference(logits, params, [r.prompt_token_ids for r in rows], [r.output_token_ids for r in rows], [])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        for r in requests:   # this step's tokens join the output (drafts never do)
            r.output_token_ids += [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]


def test_repeated_bias_entries_for_one_token_keep_the_last():
    assert SamplingParams(logit_bias=((3, 1.0), (3, -2.0))).logit_bias == ((3, -2.0),)


@pytest.mark.parametrize("kw", [dict(presence_penalty=2.5), dict(frequency_penalty=float("nan")),
                                dict(repetition_penalty=0.0), dict(min_tokens=65), dict(top_logprobs=21),
                                dict(logit_bias=((1, 101.0),)), dict(logit_bias=((-1, 1.0),))])
def test_out_of_range_values_are_rejected(kw):
    with pytest.raises(InvalidInputError):
        SamplingParams(**kw)


@pytest.mark.parametrize("loop", ["off", "on"])
def test_min_tokens_and_logit_bias_end_to_end(load_backend, loop):
    base = build_request("m", PROMPTS["text"], random.randrange(10_000), max_tokens=10)
    llm = make_llm(load_backend("sdpa"), attention_backend="sdpa", async_scheduling=loop)
    free = llm.generate([base])[0]
    # the 3rd greedy token becomes end-of-sequence: without min_tokens the run stops there
    llm.core.eos_token_ids = frozenset({free.token_ids[2]})
    llm.core.sampler.eos_token_ids = (free.token_ids[2],)
    sp = dataclasses.replace(base.sampling, ignore_eos=False)
    stopped = llm.generate([base], sp)[0]
    assert stopped.finish_reason == "eos" and len(stopped.token_ids) <= 3
    held = llm.generate([base], dataclasses.replace(sp, min_tokens=7))[0]
    assert free.token_ids[2] not in held.token_ids[:7] and len(held.token_ids) >= 7
    # a +100 bias makes a token the greedy choice at every step; -100 on the greedy token removes it
    favourite = 40
    biased = llm.generate([base], dataclasses.replace(sp, logit_bias=((favourite, 100.0),), ignore_eos=True))[0]
    assert biased.token_ids == [favourite] * 10
    banned = llm.generate([base], dataclasses.replace(base.sampling, logit_bias=((free.token_ids[0], -100.0),)))[0]
    assert free.token_ids[0] not in banned.token_ids


@pytest.mark.parametrize("loop", ["off", "on"])
def test_min_tokens_hold_back_stop_strings(load_backend, loop):
    """(Async scheduling: each generate reuses the id "s" while the step after the last one's stop is
    still in flight.)"""
    llm = make_llm(load_backend("sdpa"), attention_backend="sdpa", async_scheduling=loop)
    for _ in range(20):   # a random prompt whose greedy text shows a visible character early
        base = build_request("s", PROMPTS["text"], random.randrange(10_000), max_tokens=12)
        full = llm.generate([base])[0]
        visible = [i for i, c in enumerate(full.text[:8]) if c.strip() and c != "\ufffd"]
        if visible:
            break
    stop = full.text[visible[0]]
    early = llm.generate([base], dataclasses.replace(base.sampling, stop=(stop,)))[0]
    assert early.finish_reason == "stop" and early.token_ids == full.token_ids[:len(early.token_ids)]
    hold = min(12, len(early.token_ids) + 4)
    # min_tokens also bans EOS until `hold` (and the prompts run with ignore_eos), so the reference is
    # the same request with min_tokens and no stop string: it differs from `full` where greedy chose EOS.
    held = llm.generate([base], dataclasses.replace(base.sampling, min_tokens=hold))[0]
    late = llm.generate([base], dataclasses.replace(base.sampling, stop=(stop,), min_tokens=hold))[0]
    assert len(late.token_ids) >= hold and late.token_ids[:hold] == held.token_ids[:hold]
