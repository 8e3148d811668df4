"""Structured output: token masks that keep a request's output inside a JSON schema, regex or grammar.

xgrammar does the work (chosen over llguidance by per-token mask time on this model's tokenizer,
docs/benchmarks.md). Grammars are compiled off the step loop by `format_compiler.FormatCompiler`
(once per spec hash, LRU); each request gets its own matcher. Per step, every constrained row's
allowed-token bitmask is filled on the host in one batched call, before anything waits on the
device, so on a GPU it runs while the forward pass is still executing; the mask is then applied
to all rows at once on the device. A row whose grammar admits no token, or rejects the sampled
one, fails that request alone: its step-mates never see it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import xgrammar as xgr

from mmserve.engine.format_compiler import FormatCompiler, field_name
from mmserve.engine.sampling_params import ResponseFormat
from mmserve.errors import InvalidInputError

logger = logging.getLogger(__name__)


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf wherever bit t of bitmask[i] (int32 words) is 0."""
    words = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(words.shape[0], -1)[:, :logits.shape[1]].bool()
    rows = rows.to(logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


class StructuredOutput:
    """One matcher per constrained request, and the step's masks; compiled grammars come from `compiler`."""

    def __init__(self, compiler: FormatCompiler):
        self.compiler = compiler
        self.vocab_size = compiler.vocab_size
        self._matchers: dict[str, xgr.GrammarMatcher] = {}
        self._formats: dict[str, ResponseFormat] = {}
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        self._bitmask = xgr.allocate_token_bitmask(8, self.vocab_size)

    def add(self, request_id: str, fmt: ResponseFormat, compiled: xgr.CompiledGrammar) -> None:
        self._matchers[request_id] = xgr.GrammarMatcher(compiled)
        self._formats[request_id] = fmt

    # -- engine core, once per step --------------------------------------------------------------

    def fill(self, requests: Sequence) -> tuple[list[int], torch.Tensor, dict[int, InvalidInputError]] | None:
        """Host side of a step: the constrained rows, their bitmasks and the rows whose grammar admits
        no token at all (index into `requests` -> why); None if no row is constrained."""
        rows = [i for i, r in enumerate(requests) if r.request_id in self._matchers]
        if not rows:
            return None
        if self._bitmask.shape[0] < len(rows):
            self._bitmask = xgr.allocate_token_bitmask(2 * len(rows), self.vocab_size)
        bitmask = self._bitmask[:len(rows)]
        matchers = [self._matchers[requests[i].request_id] for i in rows]
        try:
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask)
        except Exception:   # find the culprit row by row, so the others keep their masks
            logger.exception("batched grammar mask failed; filling row by row")
            bitmask.fill_(0)
            for k, matcher in enumerate(matchers):
                try:
                    matcher.fill_next_token_bitmask(bitmask, k)
                except Exception:
                    logger.exception("request %s: grammar mask failed", requests[rows[k]].request_id)
        dead = {rows[k]: self._stuck(requests[rows[k]]) for k in torch.nonzero(~bitmask.any(dim=1)).flatten().tolist()
                if not matchers[k].is_terminated()}
        return rows, bitmask, dead

    def accept(self, requests: Sequence, tokens: Sequence[int]) -> dict[int, InvalidInputError]:
        """Advance every constrained row's matcher past its sampled token; the rows (index into
        `requests`) whose matcher refused it, with why."""
        refused = {}
        for k, (r, t) in enumerate(zip(requests, tokens, strict=True)):
            matcher = self._matchers.get(r.request_id)
            if matcher is None or matcher.is_terminated():
                continue
            try:
                accepted = matcher.accept_token(t)
            except Exception:
                logger.exception("request %s: grammar matcher failed", r.request_id)
                accepted = False
            if not accepted:
                refused[k] = self._stuck(r)
        return refused

    def _stuck(self, request) -> InvalidInputError:
        fmt = self._formats[request.request_id]
        return InvalidInputError(field_name(fmt), f"after {len(request.output_token_ids)} generated tokens no "
                                 "token can continue the output (the format reaches a state it cannot leave)")

    def is_complete(self, request_id: str) -> bool:
        """True unless the request is constrained and its output so far is not a whole match."""
        matcher = self._matchers.get(request_id)
        return matcher is None or matcher.is_completed() or matcher.is_terminated()

    def free(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._formats.pop(request_id, None)
