"""Acceptance: a step's sampled rows turned into each request's new tokens.

A plain request takes its row's token. A verify chunk (speculative decoding: `[last, d1..dk]`,
one row per position, then pad positions that fill it to the step's uniform 1 + K rows, which the
runner never samples) keeps the longest prefix of drafts the target confirms plus the target's
own next token: greedy requests compare the drafts with the rows' argmax; random ones are decided
by rejection sampling (`verify`), which keeps the target's distribution exactly: the drafter is
greedy (its proposal q is one-hot on d), so each draft d is kept with probability p(d), and the
first one rejected is replaced by a draw from p without d. Either way the tokens are cut at EOS and
`max_tokens`; the positions after the cut are what the scheduler rolls back.
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


def keeps_draft(u: torch.Tensor, p_draft: torch.Tensor) -> torch.Tensor:
    """Keep a greedy draft with probability min(1, p(d) / q(d)) = p(d) (q is one-hot on d): u ~ U[0, 1)."""
    return u < p_draft


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
    """Accepts a step's rows with `sampler`'s generators and final logits (so a verify row is adjusted,
    masked and drawn exactly as a plain step's row would be); `record(drafts, kept)` hears every
    verify chunk scored (the speculator's acceptance statistics)."""

    def __init__(self, sampler: Sampler, record: Callable[[int, int], None] | None = None):
        self.sampler = sampler
        self.record = record

    def accept(self, scheduled: Sequence[ScheduledRequest], sampler_out: SamplerOutput, logits: torch.Tensor,
               rows: list, eos_token_ids: frozenset[int]) -> list[Accepted]:
        """Each sampling request's new tokens, appended to it (`rows`: the sampler's row objects,
        one per logits row, as `spec_decode.verify.verify_rows` lays them out)."""
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
            if drafts and not params.greedy:
                targets = self.verify(logits[first:first + n_rows], rows[first:first + n_rows], drafts)
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

    def verify(self, logits: torch.Tensor, rows: Sequence, drafts: list[int]) -> list[int]:
        """Rejection sampling of a random request's verify chunk: raw logits [1 + K, V] (row i follows
        the i-th verified token; `rows[i]` is the request with its first i drafts as output, so bias,
        min_tokens, penalties and the grammar's mask adjust each row as a plain step would), K greedy
        drafts -> the kept drafts and one more token, distributed exactly as K + 1 plain draws would be."""
        params = [r.sampling_params for r in rows]
        gen = self.sampler.generator(rows[0].request_id, params[0], logits.device)
        probs = self.sampler.probs(self.sampler.final_logits(logits, rows, params)[0], params)
        ids = torch.tensor(drafts, dtype=torch.int64, device=logits.device)
        u = torch.rand(len(drafts), generator=gen, device=logits.device, dtype=probs.dtype)
        kept = keeps_draft(u, probs[torch.arange(len(drafts), device=logits.device), ids]).tolist()
        n = kept.index(False) if False in kept else len(drafts)
        last = probs[n].clone()
        if n < len(drafts):   # the residual max(0, p - q) for a one-hot q: p without the rejected draft
            last[drafts[n]] = 0.0
        noise = torch.empty_like(last).exponential_(generator=gen)
        return drafts[:n] + [int((last / noise).argmax())]


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
