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

With async scheduling and speculation the next step is built before this one's tokens reach the
host, so the acceptance it needs is also made on the device (`accept_on_device`): how many drafts
each chunk kept, the token after them (the next step's first input, and the drafter's), its row,
and how many of the chunk's positions the host counted that the step did not keep. The host then
accepts the same rows again (`accept`) when the tokens land: the same rule on the same tokens.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mmserve.attention.buffers import to_device
from mmserve.core.sched.output import ScheduledRequest
from mmserve.errors import MMServeError
from mmserve.ipc.protocol import TokenLogprobs
from mmserve.sample.sampler import Sampler, SamplerOutput


@dataclass(slots=True)   # one per sampling request per step
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

    def __init__(self, sampler: Sampler, record: Callable[[np.ndarray, np.ndarray], None] | None = None):
        self.sampler = sampler
        self.record = record

    def accept(self, scheduled: Sequence[ScheduledRequest], sampler_out: SamplerOutput,
               eos_token_ids: frozenset[int]) -> list[Accepted]:
        """Each sampling request's new tokens, appended to it (the sampler's rows laid out as
        `spec_decode.verify.verify_rows` lays them: a verify chunk's 1 + K rows in a row). The
        drafts kept are counted for every chunk at once (numpy over `acceptance_layout`, the
        device's rule); the loop per request only cuts, appends and reports."""
        layout = acceptance_layout(scheduled)
        width = (layout.shape[1] - 2) // 2
        drawn = np.asarray(sampler_out.token_ids, dtype=np.int64)[layout[:, :width + 1]]   # each chunk's rows
        num_drafts = layout[:, width] - layout[:, 0]   # a chunk's rows stop at its own last: first + drafts
        kept = (drawn[:, :width] == layout[:, width + 1:-1]).cumprod(axis=1).sum(axis=1)   # -1: no draft, never kept
        errors = sampler_out.errors
        # this request's own failure, on any of its rows (a failed row's token is a placeholder): it ends alone
        failed = ({int(np.searchsorted(layout[:, 0], r, side="right")) - 1: errors[r]   # its first failed row's
                   for r in sorted(errors, reverse=True)} if errors else {})
        if self.record is not None and (verified := np.flatnonzero(num_drafts > 0)).size:
            verified = verified[[i not in failed for i in verified.tolist()]] if failed else verified
            self.record(num_drafts[verified], kept[verified])
        accepted = []
        for i, (s, targets, num_accepted) in enumerate(zip(scheduled, drawn.tolist(), kept.tolist(), strict=True)):
            request, drafts = s.request, s.draft_token_ids
            if i in failed:
                accepted.append(Accepted(s, [], None, None, len(drafts) + s.num_pad_drafts, failed[i]))
                continue
            tokens, finish = _cut(request, targets[:num_accepted + 1], eos_token_ids)
            if drafts and (error := self.sampler.accept_verified(request, tokens)) is not None:
                accepted.append(Accepted(s, [], None, None, len(drafts) + s.num_pad_drafts, error))
                continue
            request.output_token_ids += tokens
            # kept token k is row first + k's draw: its logprob came with the tokens (no second read)
            first = int(layout[i, 0])
            logprobs = (None if request.sampling_params.num_logprobs is None
                        else sampler_out.logprobs[first:first + len(tokens)])
            accepted.append(Accepted(s, tokens, logprobs, finish, 1 + len(drafts) + s.num_pad_drafts - len(tokens),
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


@dataclass
class DeviceAcceptance:
    """A step's acceptance on the device, per sampling request (async scheduling with speculation)."""

    next_token: torch.Tensor   # [S] the token after the kept drafts (the target's draw at `row`)
    row: torch.Tensor          # [S] its row among the step's sampled rows
    shift: torch.Tensor        # [S] positions the host counted as kept (every draft and pad) and were not


def acceptance_layout(scheduled: Sequence[ScheduledRequest]) -> np.ndarray:
    """The host's part of `accept_on_device`, numpy over the batch: per sampling request, its rows
    among the step's sampled rows (laid out as `verify_rows` lays them; clamped to its own, so a
    short chunk repeats its last row), its drafts (-1 past them) and the positions the host counted
    for it (drafts and pads): int64 [S, 2 * width + 2], width the most drafts a request has."""
    n = len(scheduled)
    counts = np.fromiter((len(s.draft_token_ids) for s in scheduled), dtype=np.int64, count=n)
    pads = np.fromiter((s.num_pad_drafts for s in scheduled), dtype=np.int64, count=n)
    width = int(counts.max(initial=0))
    first = np.concatenate(([0], np.cumsum(1 + counts)[:-1]))
    layout = np.full((n, 2 * width + 2), -1, dtype=np.int64)
    layout[:, :width + 1] = first[:, None] + np.minimum(np.arange(width + 1), counts[:, None])
    if width:   # every draft at once: request i's j-th in column width + 1 + j
        drafts = np.fromiter(itertools.chain.from_iterable(s.draft_token_ids for s in scheduled), dtype=np.int64,
                             count=int(counts.sum()))
        owner = np.repeat(np.arange(n), counts)
        layout[owner, width + 1 + np.arange(len(drafts)) - np.repeat(np.cumsum(counts) - counts, counts)] = drafts
    layout[:, -1] = counts + pads
    return layout


def accept_on_device(tokens: torch.Tensor, layout: np.ndarray) -> DeviceAcceptance:
    """`accept`'s rule on the device, without EOS or max_tokens (a request they end is dropped from
    the next step when the host learns it): `tokens` are the step's sampled rows laid out as
    `verify_rows` lays them; `layout` (`acceptance_layout`) each sampling request's rows and drafts
    (host-known by the time its rows are sampled). No host sync: the layout goes over in one copy."""
    width = (layout.shape[1] - 2) // 2
    layout_dev = to_device(layout, tokens.device)
    rows, drafts, counted = layout_dev[:, :width + 1], layout_dev[:, width + 1:-1], layout_dev[:, -1]
    drawn = tokens.index_select(0, rows.flatten()).view(rows.shape)
    kept = (drawn[:, :width] == drafts).long().cumprod(dim=1).sum(dim=1)   # a -1 (no draft) never matches
    return DeviceAcceptance(drawn.gather(1, kept[:, None]).squeeze(1), rows[:, 0] + kept, counted - kept)
