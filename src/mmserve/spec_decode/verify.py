"""A verify chunk's rows: who speculates, the rows the sampler sees (kept by chunk: `StepRows`), how
many drafts the target kept.

Plain data and pure functions shared by the engine core's step (sampling and acceptance,
`sample/rejection_sampler.py`) and the drafter (`speculator.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

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


class StepRows(Sequence):
    """The sampler's rows of a step, kept by chunk: chunk c (`requests[c]`, a scheduler Request or
    any row object, with `drafts[c]`) gives 1 + len(drafts[c]) consecutive rows, row j of a chunk
    with drafts being `VerifyRow(request, drafts[:j])` (a chunk without drafts: its request). The
    sampler plans per chunk with numpy and repeats over its rows (`counts`, `chunk_of_row`,
    `depth`: the drafts before each row); a row object is made only where one is asked for (a
    constrained, penalised or random row), not 1 + K per request per step."""

    def __init__(self, requests: Sequence, drafts: Sequence[Sequence[int]]):
        self.requests, self.drafts = list(requests), list(drafts)
        self._len = len(self.requests) + sum(map(len, self.drafts))

    @cached_property
    def counts(self) -> np.ndarray:
        """Rows per chunk (int64)."""
        return np.fromiter(map(len, self.drafts), dtype=np.int64, count=len(self.drafts)) + 1

    @cached_property
    def starts(self) -> np.ndarray:
        """Chunk c's rows are starts[c] .. starts[c + 1] - 1 (int64, one more than the chunks)."""
        starts = np.zeros(len(self.requests) + 1, dtype=np.int64)
        np.cumsum(self.counts, out=starts[1:])
        return starts

    @cached_property
    def chunk_of_row(self) -> np.ndarray:
        return np.repeat(np.arange(len(self.requests)), self.counts)

    @cached_property
    def depth(self) -> np.ndarray:
        """The drafts before each row in its chunk (its row index there)."""
        return np.arange(self._len) - self.starts[self.chunk_of_row]

    @classmethod
    def of(cls, rows: Sequence) -> StepRows:
        """Rows given one by one (Requests or VerifyRows): each its own chunk of one row."""
        return rows if isinstance(rows, StepRows) else cls(rows, [()] * len(rows))

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int):
        if self._len == len(self.requests):   # no drafts in the step: row i is chunk i's request
            return self.requests[i]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        c = int(self.chunk_of_row[i])
        drafts = self.drafts[c]
        return VerifyRow(self.requests[c], tuple(drafts[:int(self.depth[i])])) if drafts else self.requests[c]

    def rows_where(self, chunks: np.ndarray) -> np.ndarray:
        """The rows (int64, ascending) of the chunks where `chunks` (bool, one per chunk) holds."""
        return np.flatnonzero(chunks if self._len == len(self.requests) else np.repeat(chunks, self.counts))

    def output_lengths(self) -> np.ndarray:
        """Each row's output length as the sampler sees it: its request's, plus the drafts before it."""
        base = np.fromiter((len(r.output_token_ids) for r in self.requests), dtype=np.int64, count=len(self.requests))
        return base[self.chunk_of_row] + self.depth


def verify_rows(scheduled) -> StepRows:
    """The sampler's rows of a step: each plain sampling request, or a verify chunk's 1 + K VerifyRows."""
    return StepRows([s.request for s in scheduled], [s.draft_token_ids for s in scheduled])


def accepted_prefix(drafts: list[int], targets: list[int]) -> int:
    """How many leading drafts equal the target's tokens at their positions (targets[i] follows
    the i-th verified token)."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return n
