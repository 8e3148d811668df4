"""Acceptance: a step's sampled rows turned into each request's new tokens.

A plain request takes its row's token. A verify chunk (speculative decoding: `[last, d1..dk]`,
one row per position, then pad positions that fill it to the step's uniform 1 + K rows, which the
runner never samples) keeps the longest prefix of drafts equal to its rows' tokens plus the row
after it, greedy and random requests alike. For a random request that is rejection sampling: each
row was drawn once, exactly as the plain step at its position would be (sampler.py), and the
drafter is greedy (its proposal is one-hot on d), so a draft is kept with probability p(d), and
when not, the row's token is a draw from p conditioned on not being d: the residual, the target's
distribution exactly. It uses no randomness of its own, so a seeded request gives the same tokens
with speculation on and off, whatever rows its batch-mates left it. Either way the tokens are cut at
EOS and `max_tokens`; the positions after the cut are what the scheduler rolls back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mmserve.core.sched.output import ScheduledRequest
from mmserve.errors import MMServeError
from mmserve.ipc.protocol import TokenLogprobs
from mmserve.sample.logprobs import token_logprobs
from mmserve.sample.sampler import Sampler, SamplerOutput
from mmserve.spec_decode.verify import accepted_prefix


@dataclass
class Accepted:
    """One sampling request's outcome of a step: its new tokens, and how many of its chunk's
    positions (rejected drafts, pad positions, or those past an end) the scheduler rolls back."""

    scheduled: ScheduledRequest
    tokens: list[int]
    logprobs: list[TokenLogprobs | None] | None
    finish_reason: str | None
    rejected: int
    error: MMServeError | None = None
    num_accepted: int = 0   # drafts the target kept (speculation), before any EOS/max_tokens cut


class RejectionSampler:
    """Accepts a step's rows as `sampler` drew them (a verify row adjusted, masked and drawn exactly
    as a plain step's row would be); `record(drafts, kept)` hears every verify chunk scored (the
    speculator's acceptance statistics)."""

    def __init__(self, sampler: Sampler, record: Callable[[int, int], None] | None = None):
        self.sampler = sampler
        self.record = record

    def accept(self, scheduled: Sequence[ScheduledRequest], sampler_out: SamplerOutput, logits: torch.Tensor,
               eos_token_ids: frozenset[int]) -> list[Accepted]:
        """Each sampling request's new tokens, appended to it (the sampler's rows laid out as
        `spec_decode.verify.verify_rows` lays them: a verify chunk's 1 + K rows in a row)."""
        accepted, row = [], 0
        for s in scheduled:
            request, drafts = s.request, s.draft_token_ids
            n_rows = 1 + len(drafts)
            first, row = row, row + n_rows
            # this request's own failure, on any of its rows (a failed row's token is a placeholder): it ends alone
            if (error := next((sampler_out.errors[r] for r in range(first, row) if r in sampler_out.errors), None)) is not None:
                accepted.append(Accepted(s, [], None, None, len(drafts) + s.num_pad_drafts, error))
                continue
            targets = sampler_out.token_ids[first:first + n_rows]
            params = request.sampling_params
            num_accepted = accepted_prefix(drafts, targets)
            if drafts and self.record is not None:
                self.record(len(drafts), num_accepted)
            tokens, finish = _cut(request, targets[:num_accepted + 1], eos_token_ids)
            if drafts and (error := self.sampler.accept_verified(request, tokens)) is not None:
                accepted.append(Accepted(s, [], None, None, len(drafts) + s.num_pad_drafts, error))
                continue
            request.output_token_ids += tokens
            logprobs = None if sampler_out.logprobs[first] is None else [sampler_out.logprobs[first]]
            if n_rows > 1 and params.num_logprobs is not None:   # each kept token's, under its own row
                logprobs = token_logprobs(logits[first:first + len(tokens)], torch.tensor(tokens),
                                          [params.num_logprobs] * len(tokens))
            accepted.append(Accepted(s, tokens, logprobs, finish, n_rows + s.num_pad_drafts - len(tokens),
                                     num_accepted=num_accepted))
        return accepted


def _cut(request, candidates: list[int], eos_token_ids: frozenset[int]) -> tuple[list[int], str | None]:
    """The candidates up to and including the first that ends the request (EOS, max_tokens)."""
    params = request.sampling_params
    tokens = []
    for token in candidates:
        tokens.append(token)
        if token in eos_token_ids and not params.ignore_eos:
            return tokens, "eos"
        if len(request.output_token_ids) + len(tokens) >= params.max_tokens:
            return tokens, "length"
    return tokens, None
