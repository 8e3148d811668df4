"""A verify chunk's rows: who speculates, the rows the sampler sees, how many drafts the target kept.

Plain data and pure functions shared by the engine core's step (sampling and acceptance,
`sample/rejection_sampler.py`) and the drafter (`speculator.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.request import Request
from mmserve.sampling_params import SamplingParams


def speculates(params: SamplingParams) -> bool:
    return not params.disable_speculation


@dataclass(frozen=True)
class VerifyRow:
    """Row j of a verify chunk as the sampler sees it: the request with its first j drafts
    (`drafts`) as output, so penalties, min_tokens, logit_bias and the grammar's mask adjust each
    row exactly as the step that would have sampled that position alone."""

    request: Request
    drafts: tuple[int, ...]

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def sampling_params(self) -> SamplingParams:
        return self.request.sampling_params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + list(self.drafts)


def verify_rows(scheduled) -> list:
    """The sampler's rows of a step: each plain sampling request, or a verify chunk's 1 + K VerifyRows."""
    return [VerifyRow(s.request, tuple(s.draft_token_ids[:j])) if s.draft_token_ids else s.request
            for s in scheduled for j in range(1 + len(s.draft_token_ids))]


def accepted_prefix(drafts: list[int], targets: list[int]) -> int:
    """How many leading drafts equal the target's tokens at their positions (targets[i] follows
    the i-th verified token)."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return n
