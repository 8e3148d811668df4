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
from mmserve.spec_decode.verify import StepRows, accepted_prefix, verify_rows


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
    as a plain step's row would be); `record(drafts, kept)` hears a step's verify chunks once, as arrays
    (one entry per chunk: the speculator's acceptance statistics)."""

    def __init__(self, sampler: Sampler, record: Callable[[np.ndarray, np.ndarray], None] | None = None):
        self.sampler = sampler
        self.record = record

    def accept(self, scheduled: Sequence[ScheduledRequest], sampler_out: SamplerOutput,
               eos_token_ids: frozenset[int]) -> list[Accepted]:
        """Each sampling request's new tokens, appended to it (the sampler's rows laid out as
        `spec_decode.verify.verify_rows` lays them: a verify chunk's 1 + K rows in a row). The
        chunks verified are recorded together, once."""
        accepted, row, errors = [], 0, sampler_out.errors
        verified, kept = [], []   # per verify chunk scored: its drafts, how many the target kept
        for s in scheduled:
            request, drafts = s.request, s.draft_token_ids
            n_rows = 1 + len(drafts)
            first, row = row, row + n_rows
            # this request's own failure, on any of its rows (a failed row's token is a placeholder): it ends alone
            if errors and (error := next((errors[r] for r in range(first, row) if r in errors), None)) is not None:
                accepted.append(Accepted(s, [], None, None, len(drafts) + s.num_pad_drafts, error))
                continue
            targets = sampler_out.token_ids[first:row]
            num_accepted = 0
            if drafts:
                num_accepted = accepted_prefix(drafts, targets)
                verified.append(len(drafts))
                kept.append(num_accepted)
            tokens, finish = _cut(request, targets[:num_accepted + 1], eos_token_ids)
            if drafts and (error := self.sampler.accept_verified(request, tokens)) is not None:
                accepted.append(Accepted(s, [], None, None, len(drafts) + s.num_pad_drafts, error))
                continue
            request.output_token_ids += tokens
            # kept token k is row first + k's draw: its logprob came with the tokens (no second read)
            logprobs = (None if request.sampling_params.num_logprobs is None
                        else sampler_out.logprobs[first:first + len(tokens)])
            accepted.append(Accepted(s, tokens, logprobs, finish, n_rows + s.num_pad_drafts - len(tokens),
                                     num_accepted=num_accepted))
        if verified and self.record is not None:
            self.record(np.array(verified), np.array(kept))
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


def acceptance_layout(scheduled: Sequence[ScheduledRequest], rows: StepRows | None = None) -> np.ndarray:
    """The host's part of `accept_on_device`, numpy over the batch: per sampling request, its rows
    among the step's sampled rows (`rows`, `verify_rows(scheduled)`; clamped to its own, so a
    short chunk repeats its last row), its drafts (-1 past them) and the positions the host counted
    for it (drafts and pads): int64 [S, 2 * width + 2], width the most drafts a request has."""
    rows = verify_rows(scheduled) if rows is None else rows
    n = len(scheduled)
    width = max(map(len, rows.drafts), default=0)
    layout = np.full((n, 2 * width + 2), -1, dtype=np.int64)
    if len(rows) == n * (1 + width):   # a uniform verify step (or none): every chunk has `width` drafts
        counts = width
        layout[:, :width + 1] = np.arange(0, len(rows), 1 + width)[:, None] + np.arange(width + 1)
        if width:
            layout[:, width + 1:-1] = np.array(rows.drafts, dtype=np.int64).reshape(n, width)
    else:
        counts = rows.counts - 1
        layout[:, :width + 1] = rows.starts[:-1, None] + np.minimum(np.arange(width + 1), counts[:, None])
        drafts = np.flatnonzero(rows.depth)   # draft j of a chunk is its row j + 1, in column width + 1 + j
        layout[rows.chunk_of_row[drafts], width + rows.depth[drafts]] = np.fromiter(
            itertools.chain.from_iterable(rows.drafts), dtype=np.int64, count=len(drafts))
    layout[:, -1] = counts + np.fromiter((s.num_pad_drafts for s in scheduled), dtype=np.int64, count=n)
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
