"""The host's planning of a speculating step, per chunk with numpy, equals its per-row definition.

A step's 1 + K verify rows per request used to be planned row by row (a VerifyRow object per row,
then a Python pass per row in the sampler and its adjustments, a pass per request to lay out the
device acceptance's drafts, a call per verify chunk to record its acceptance). Now the sampler
plans per chunk and repeats over the rows (`StepRows`), the layout is numpy over the batch, and
the acceptance records once. Each test writes the old per-row definition out and compares on random
batches from fresh seeds: mixed draft counts (none: `disable_speculation` or near max_tokens),
greedy, random, seeded, penalised, biased, min_tokens, logprobs and grammar rows, so a row
misplaced by one fails.
"""

from __future__ import annotations

import json
import random
import types

import numpy as np
import pytest
import torch

from mmserve.config import DEMO_MODEL_DIR
from mmserve.core.sched.output import ScheduledRequest
from mmserve.model.tokenizer import load_tokenizer
from mmserve.request import Request
from mmserve.sample.rejection_sampler import Accepted, RejectionSampler, acceptance_layout
from mmserve.sample.row_values import RowValues
from mmserve.sample.sampler import Draws, Sampler, SamplerOutput
from mmserve.sampling_params import ResponseFormat, SamplingParams
from mmserve.spec_decode.speculator import Speculator
from mmserve.spec_decode.verify import VerifyRow, verify_rows
from mmserve.structured_output.compiler import FormatCompiler
from mmserve.structured_output.manager import StructuredOutput

K = 3
EOS = (1, 106)
SCHEMA = ResponseFormat("json_schema", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}}))


@pytest.fixture(scope="module")
def grammar_parts():
    tokenizer = load_tokenizer(DEMO_MODEL_DIR)
    compiler = FormatCompiler(tokenizer, tokenizer.vocab_size, list(EOS), cache_bytes=2**24, timeout_s=60.0)
    compiled = compiler.submit(SCHEMA).result()
    yield compiler, compiled, tokenizer.vocab_size
    compiler.shutdown()


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    kind = rng.choice(["greedy", "random", "seeded", "penalised", "biased", "min_tokens", "logprobs", "grammar"])
    options = dict(max_tokens=rng.randint(2, 40), disable_speculation=rng.random() < 0.15)
    if kind in ("random", "seeded"):
        options.update(temperature=rng.uniform(0.3, 1.5), top_k=rng.choice([0, 5, vocab + 3]),
                       top_p=rng.choice([1.0, 0.8]), seed=rng.randrange(2**31) if kind == "seeded" else None)
    elif kind == "penalised":
        options.update(presence_penalty=rng.uniform(-1, 1), frequency_penalty=rng.uniform(-1, 1),
                       repetition_penalty=rng.choice([1.0, 1.3]))
    elif kind == "biased":
        options.update(logit_bias=tuple((rng.randrange(vocab), rng.uniform(-5, 5)) for _ in range(rng.randint(1, 3))))
    elif kind == "min_tokens":
        options.update(min_tokens=rng.randint(1, options["max_tokens"]))
    elif kind == "logprobs":
        options.update(logprobs=True, top_logprobs=rng.randint(0, 4))
    elif kind == "grammar":
        options.update(response_format=SCHEMA)
    if rng.random() < 0.3:   # two kinds on one request
        options.update(logprobs=True, top_logprobs=2, presence_penalty=0.5)
    return SamplingParams(**options)


def random_step(rng: random.Random, vocab: int) -> list[ScheduledRequest]:
    """A step's sampling chunks: each request with some output, and 0..K drafts (none where it
    opted out or is near its max_tokens)."""
    step = []
    for i in range(rng.randint(1, 16)):
        params = random_params(rng, vocab)
        request = Request(f"r{i}", [rng.randrange(vocab) for _ in range(rng.randint(1, 6))], params)
        request.output_token_ids = [rng.randrange(vocab) for _ in range(rng.randint(0, params.max_tokens - 1))]
        left = params.max_tokens - len(request.output_token_ids) - 1
        drafts = 0 if params.disable_speculation else rng.randint(0, min(K, left))
        step.append(ScheduledRequest(request, 1 + drafts, 0, False, draft_token_ids=[rng.randrange(vocab)
                                                                                  for _ in range(drafts)],
                                     num_pad_drafts=rng.choice([0, K - drafts])))
    return step


def per_row_rows(scheduled) -> list:
    """The old `verify_rows`: a row object per row."""
    return [VerifyRow(s.request, tuple(s.draft_token_ids[:j])) if s.draft_token_ids else s.request
            for s in scheduled for j in range(1 + len(s.draft_token_ids))]


def per_row_values(sampler: Sampler, requests: list, vocab: int) -> tuple[dict[str, np.ndarray], object]:
    """The old `Sampler.launch` and `Adjustments` planning: one Python pass per row."""
    values = RowValues()
    params, want_lp, random_rows = [], [], []
    for i, r in enumerate(requests):
        p = r.sampling_params
        params.append(p)
        if p.num_logprobs is not None:
            want_lp.append(i)
        if not p.greedy:
            random_rows.append(i)
    masks = sampler.grammar.fill(requests) if sampler.grammar is not None else None
    values.ids("logprob_rows", want_lp)
    biased, short, penalised = [], [], []
    for r, (p, q) in enumerate(zip(params, requests, strict=True)):
        if p.logit_bias:
            biased.append(r)
        if p.min_tokens and len(q.output_token_ids) < p.min_tokens:
            short.append(r)
        if p.has_penalties:
            penalised.append(r)
    if biased:
        values.ids("bias_rows", [r for r in biased for _ in params[r].logit_bias])
        values.ids("bias_tokens", [t for r in biased for t, _ in params[r].logit_bias])
        values.floats("bias_values", [b for r in biased for _, b in params[r].logit_bias])
    if short and sampler.eos_token_ids:
        values.ids("min_tokens_rows", short)
        values.ids("eos_ids", list(sampler.eos_token_ids))
    if penalised:
        values.ids("penalised_rows", penalised)
        values.floats("repetition", [params[r].repetition_penalty for r in penalised])
        values.floats("frequency", [params[r].frequency_penalty for r in penalised])
        values.floats("presence", [params[r].presence_penalty for r in penalised])
        sampler.penalties.plan(values, [requests[r] for r in penalised], vocab,
                               any(params[r].repetition_penalty != 1.0 for r in penalised))
    if masks is not None:
        values.ids("mask_rows", masks[0])
        values.words("mask_words", masks[1].numpy())
    values.ids("random_rows", random_rows)
    if random_rows:
        Draws(values, [requests[i] for i in random_rows], vocab)
    return values._arrays, masks


def test_sampler_plans_per_chunk_as_row_by_row(grammar_parts):
    compiler, compiled, vocab = grammar_parts
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    # two samplers walk the same steps (penalty slots are state): one plans per chunk, one row by row
    by_chunk, by_row = (Sampler(0, EOS, StructuredOutput(compiler), max_num_seqs=64) for _ in range(2))
    for step in range(6):
        scheduled = random_step(rng, vocab)
        for s in scheduled:
            if s.request.sampling_params.response_format is not None:
                s.request.output_token_ids = []
                for sampler in (by_chunk, by_row):
                    sampler.grammar.add(s.request.request_id, SCHEMA, compiled)
        rows = verify_rows(scheduled)
        old_rows = per_row_rows(scheduled)
        assert list(rows) == old_rows, f"seed {seed} step {step}"
        plan = by_chunk._plan(rows, vocab)
        want, want_masks = per_row_values(by_row, old_rows, vocab)
        got = plan.values._arrays
        assert list(got) == list(want), f"seed {seed} step {step}: planned {list(got)}, by rows {list(want)}"
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"seed {seed} step {step}: {name}")
        assert (plan.masks is None) == (want_masks is None)
        assert plan.want_lp == want["logprob_rows"].tolist()
        assert plan.num_top == [old_rows[i].sampling_params.num_logprobs for i in plan.want_lp]
        for rid in {s.request.request_id for s in scheduled}:
            for sampler in (by_chunk, by_row):
                sampler.free(rid)


def per_row_layout(scheduled) -> np.ndarray:
    """The old `accept_on_device` host layout: a Python pass per request for its drafts."""
    counts = np.array([len(s.draft_token_ids) for s in scheduled], dtype=np.int64)
    pads = np.array([s.num_pad_drafts for s in scheduled], dtype=np.int64)
    width = int(counts.max(initial=0))
    first = np.concatenate(([0], np.cumsum(1 + counts)[:-1]))
    layout = np.full((len(scheduled), 2 * width + 2), -1, dtype=np.int64)
    layout[:, :width + 1] = first[:, None] + np.minimum(np.arange(width + 1), counts[:, None])
    for i, s in enumerate(scheduled):
        layout[i, width + 1:width + 1 + counts[i]] = s.draft_token_ids
    layout[:, -1] = counts + pads
    return layout


def per_request_accept(scheduled, out: SamplerOutput, eos: frozenset[int], record) -> list[tuple]:
    """The old `RejectionSampler.accept` (no grammar): per request, the longest matching prefix of
    drafts, cut at EOS and max_tokens."""
    result, row = [], 0
    for s in scheduled:
        request, drafts = s.request, s.draft_token_ids
        first, row = row, row + 1 + len(drafts)
        error = next((out.errors[r] for r in range(first, row) if r in out.errors), None)
        if error is not None:
            result.append(([], None, len(drafts) + s.num_pad_drafts, error, 0))
            continue
        targets = out.token_ids[first:row]
        n = 0
        while n < len(drafts) and drafts[n] == targets[n]:
            n += 1
        if drafts:
            record(len(drafts), n)
        tokens, finish = [], None
        for token in targets[:n + 1]:
            tokens.append(token)
            if token in eos and not request.sampling_params.ignore_eos:
                finish = "eos"
                break
            if len(request.output_token_ids) + len(tokens) >= request.sampling_params.max_tokens:
                finish = "length"
                break
        request.output_token_ids += tokens
        result.append((tokens, finish, 1 + len(drafts) + s.num_pad_drafts - len(tokens), None, n))
    return result


def test_acceptance_for_every_chunk_at_once_is_the_per_request_rule():
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    vocab, eos = 12, frozenset({1})   # a small vocabulary: drafts are often kept, EOS often drawn
    for trial in range(20):
        scheduled = random_step(rng, vocab)
        np.testing.assert_array_equal(acceptance_layout(scheduled), per_row_layout(scheduled),
                                      err_msg=f"seed {seed} trial {trial}")
        # the rows' draws: often the chunk's own drafts (kept), sometimes not; some rows failed
        tokens = []
        for s in scheduled:
            d = s.draft_token_ids
            keep = rng.randint(0, len(d))
            tokens += d[:keep] + [rng.randrange(vocab) for _ in range(1 + len(d) - keep)]
        errors = {r: RuntimeError(f"row {r}") for r in range(len(tokens)) if rng.random() < 0.05}
        out = SamplerOutput(tokens, [None] * len(tokens), errors)
        old_outputs = {s.request.request_id: list(s.request.output_token_ids) for s in scheduled}
        counters = [types.SimpleNamespace(num_tokens=K, verified=[0] * K, accepted=[0] * K) for _ in range(2)]

        def per_chunk_record(drafts, kept, c=counters[1]):
            for i in range(drafts):
                c.verified[i] += 1
                c.accepted[i] += i < kept
        want = per_request_accept(scheduled, out, eos, per_chunk_record)
        wanted_outputs = {s.request.request_id: list(s.request.output_token_ids) for s in scheduled}
        for s in scheduled:   # back to before the step, then the batched acceptance
            s.request.output_token_ids[:] = old_outputs[s.request.request_id]
        sampler = types.SimpleNamespace(accept_verified=lambda request, tokens: None)
        got = RejectionSampler(sampler, lambda d, k, c=counters[0]: Speculator.record(c, d, k)).accept(scheduled, out, eos)
        assert all(isinstance(a, Accepted) for a in got)
        assert [(a.tokens, a.finish_reason, a.rejected, a.error, a.num_accepted) for a in got] == want, \
            f"seed {seed} trial {trial}"
        assert {s.request.request_id: s.request.output_token_ids for s in scheduled} == wanted_outputs
        assert (counters[0].verified, counters[0].accepted) == (counters[1].verified, counters[1].accepted)


def test_step_rows_index_like_the_list_of_rows():
    """`StepRows` is a Sequence of the old rows: len, index (negative too), iteration, IndexError."""
    rng = random.Random(random.getrandbits(64))
    scheduled = random_step(rng, 50)
    rows, old = verify_rows(scheduled), per_row_rows(scheduled)
    assert len(rows) == len(old) and list(rows) == old
    assert [rows[-i] for i in range(1, len(old) + 1)] == [old[-i] for i in range(1, len(old) + 1)]
    with pytest.raises(IndexError):
        rows[len(old)]
    outputs = [len(r.output_token_ids) for r in old]
    assert rows.output_lengths().tolist() == outputs
    assert rows.chunk_of_row.tolist() == [i for i, s in enumerate(scheduled) for _ in range(s.num_sampled_rows)]


def test_next_inputs_when_every_row_drafted_are_the_gathered_ones():
    """A round where every sampled row drafts skips the gather: the same next inputs as through one."""
    from mmserve.spec_decode.speculator import next_step_inputs

    gen = torch.Generator().manual_seed(random.randrange(2**31))
    rows = int(torch.randint(1, 20, (), generator=gen))
    next_token, drafts = torch.randint(0, 99, (rows,), generator=gen), torch.randint(0, 99, (rows, K), generator=gen)
    want = next_step_inputs(next_token, K, torch.arange(rows), drafts)
    assert torch.equal(next_step_inputs(next_token, K, None, drafts), want)
    assert torch.equal(want[:, 0], next_token) and torch.equal(want[:, 1:], drafts)


def test_next_inputs_of_rows_that_made_no_drafts_are_zeros():
    """Rows outside `index` (and every row when none drafted) read their token, then zeros, as
    documented, however the row-drafted path allocates its tensor."""
    from mmserve.spec_decode.speculator import next_step_inputs

    gen = torch.Generator().manual_seed(random.randrange(2**31))
    for _ in range(20):
        rows = int(torch.randint(2, 20, (), generator=gen))
        next_token = torch.randint(1, 99, (rows,), generator=gen)
        next_step_inputs(next_token, K, None, torch.randint(1, 99, (rows, K), generator=gen))   # leaves memory behind
        index = torch.randperm(rows, generator=gen)[:int(torch.randint(0, rows, (), generator=gen))].sort().values
        drafts = torch.randint(1, 99, (len(index), K), generator=gen)
        want = torch.zeros((rows, 1 + K), dtype=torch.int64)
        want[:, 0] = next_token
        want[index, 1:] = drafts
        assert torch.equal(next_step_inputs(next_token, K, index, drafts), want)
        assert torch.equal(next_step_inputs(next_token, K), torch.nn.functional.pad(next_token[:, None], (0, K)))
