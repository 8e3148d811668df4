"""Structured output: token masks that keep a request's output inside a JSON schema, regex or grammar.

xgrammar does the work (chosen over llguidance by per-token mask time on this model's tokenizer,
docs/benchmarks.md). Grammars are compiled off the step loop by `format_compiler.FormatCompiler`
(once per spec hash, LRU); each request gets its own matcher. Per step, every constrained row's
allowed-token bitmask is filled on the host in one batched call, before anything waits on the
device, so on a GPU it runs while the forward pass is still executing; the mask is then applied
to all rows at once on the device. A row whose grammar admits no token, or rejects the sampled
one, fails that request alone: its step-mates never see it.

Speculative decoding: the drafter's logits are masked as the drafts are made, each matcher run
ahead over its request's drafts and rolled back after the loop (`DraftMasks`); a verify chunk's row
j (a row with `drafts`: the j drafts before it) gets the mask of the state after those drafts, and
the core advances the matcher over the tokens it accepts (`advance`), never over a rejected draft.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
import xgrammar as xgr

from mmserve.errors import InvalidInputError
from mmserve.sample.row_values import RowValues
from mmserve.sampling_params import ResponseFormat
from mmserve.spec_decode.verify import StepRows
from mmserve.structured_output.compiler import FormatCompiler, field_name

logger = logging.getLogger(__name__)


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, words: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf wherever bit t of words[i] (int32) is 0. `rows` and `words`
    are on the logits' device, sent with the step's other values (`RowValues`: one pinned,
    non-blocking copy, so the host's bitmask is free to refill at once)."""
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(words.shape[0], -1)[:, :logits.shape[1]].bool()
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill(~allowed, float("-inf")))


class StepMasks(NamedTuple):
    """A step's grammar masks (`StructuredOutput.fill`)."""

    rows: list[int]                        # the constrained rows (index into the step's rows)
    bitmask: torch.Tensor                  # bitmask[k]: the tokens rows[k] may take (int32 words)
    dead: dict[int, InvalidInputError]     # rows whose grammar admits no token at all -> why
    matchers: list[xgr.GrammarMatcher]     # matchers[k]: rows[k]'s, which its sampled token advances


class StructuredOutput:
    """One matcher per constrained request, and the step's masks; compiled grammars come from `compiler`."""

    def __init__(self, compiler: FormatCompiler):
        self.compiler = compiler
        self.vocab_size = compiler.vocab_size
        self._matchers: dict[str, xgr.GrammarMatcher] = {}
        self._formats: dict[str, ResponseFormat] = {}
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        self._bitmask = xgr.allocate_token_bitmask(8, self.vocab_size)
        self._special: frozenset[int] = frozenset()

    def add(self, request_id: str, fmt: ResponseFormat, compiled: xgr.CompiledGrammar) -> None:
        self._matchers[request_id] = xgr.GrammarMatcher(compiled)
        self._formats[request_id] = fmt
        self._special = frozenset(compiled.tokenizer_info.special_token_ids)   # one tokenizer for every grammar

    # -- engine core, once per step --------------------------------------------------------------

    def fill(self, requests: Sequence) -> StepMasks | None:
        """Host side of a step: its `StepMasks`; None if no row is constrained. A verify chunk's row
        after drafts (a row with `drafts`) is masked in the state after them and never called dead: if
        acceptance reaches it, `advance` refuses the token it gets."""
        step = StepRows.of(requests)   # row objects are made for the constrained chunks alone
        chunks = np.fromiter((r.request_id in self._matchers for r in step.requests), dtype=bool,
                             count=len(step.requests)) if self._matchers else None
        if chunks is None or not chunks.any():
            return None
        constrained = step.rows_where(chunks).tolist()
        requests = {i: step[i] for i in constrained}
        now = [i for i in constrained if not getattr(requests[i], "drafts", ())]
        rows = now + [i for i in constrained if getattr(requests[i], "drafts", ())]   # one batched fill of `now`
        bitmask = self._scratch_bitmask(len(rows))
        matchers = [self._matchers[requests[i].request_id] for i in rows]
        self._fill_now(matchers[:len(now)], bitmask[:len(now)], [requests[i] for i in now])
        for k in range(len(now), len(rows)):
            self._fill_ahead(matchers[k], tuple(requests[rows[k]].drafts), bitmask, k, self._special)
        dead = {rows[k]: self._stuck(requests[rows[k]])
                for k in torch.nonzero(~bitmask[:len(now)].any(dim=1)).flatten().tolist()
                if not matchers[k].is_terminated()}
        return StepMasks(rows, bitmask, dead, matchers)

    def _scratch_bitmask(self, n: int) -> torch.Tensor:
        """The first n rows of one host bitmask, grown on demand: a step's masks, then its draft loop's
        (the step's are applied before the loop drafts)."""
        if self._bitmask.shape[0] < n:
            self._bitmask = xgr.allocate_token_bitmask(2 * n, self.vocab_size)
        return self._bitmask[:n]

    def _fill_now(self, matchers: list, bitmask: torch.Tensor, requests: list) -> None:
        """bitmask[k] from matchers[k] in its current state, all in one batched call."""
        if not matchers:
            return
        try:
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask)
        except Exception:   # find the culprit row by row, so the others keep their masks
            logger.exception("batched grammar mask failed; filling row by row")
            bitmask.fill_(0)
            for k, matcher in enumerate(matchers):
                try:
                    matcher.fill_next_token_bitmask(bitmask, k)
                except Exception:
                    logger.exception("request %s: grammar mask failed", requests[k].request_id)

    @staticmethod
    def _fill_ahead(matcher: xgr.GrammarMatcher, drafts: tuple[int, ...], bitmask: torch.Tensor, k: int,
                    special: frozenset[int]) -> None:
        """bitmask[k] for the state after `drafts`, the matcher left as it was. A row after a draft it
        refuses is left unmasked: acceptance cannot reach it, as the row before was masked against that
        draft; nor does a row after the stop token count (the request ends at it). (Drafts the async
        loop made unmasked may be special tokens or follow the stop token: refused without asking the
        matcher, which would log a warning for each.)"""
        n = 0
        try:
            while (n < len(drafts) and drafts[n] not in special and not matcher.is_terminated()
                   and matcher.accept_token(drafts[n])):
                n += 1
            if n == len(drafts) and not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, k)
            else:   # past the end (a draft was the stop token) or past a refused draft: nothing to mask
                bitmask[k] = -1
        finally:
            if n:
                matcher.rollback(n)

    def accept(self, matchers: Sequence[xgr.GrammarMatcher], requests: Sequence, tokens: Sequence[int]
               ) -> dict[int, InvalidInputError]:
        """Advance each of a step's matchers (`StepMasks.matchers`) past its row's sampled token; the
        rows (index into `requests`) whose matcher refused it, with why. The matchers, not a lookup by
        id: a request that ended while the step was in flight (async scheduling) advances its own
        freed matcher, never that of a new request admitted under its id; nobody reads its row."""
        refused = {}
        for k, (matcher, r, t) in enumerate(zip(matchers, requests, tokens, strict=True)):
            if matcher.is_terminated():
                continue
            try:
                accepted = matcher.accept_token(t)
            except Exception:
                logger.exception("request %s: grammar matcher failed", r.request_id)
                accepted = False
            if not accepted and self._matchers.get(r.request_id) is matcher:   # (an ended one's format is gone)
                refused[k] = self._stuck(r)
        return refused

    def advance(self, request, tokens: Sequence[int]) -> InvalidInputError | None:
        """Advance a verify chunk's matcher over the tokens the core accepted; why not, if it refuses one."""
        matcher = self._matchers.get(request.request_id)
        if matcher is None:
            return None
        for t in tokens:
            if matcher.is_terminated() or not matcher.accept_token(t):
                return self._stuck(request)
        return None

    def draft_masks(self, request_ids: Sequence[str], num_drafts: Sequence[int]) -> DraftMasks | None:
        """The grammar of one draft loop over these requests (num_drafts each); None if none is constrained."""
        rows = [k for k, rid in enumerate(request_ids) if rid in self._matchers]
        return DraftMasks(self, [self._matchers[request_ids[k]] for k in rows], rows, num_drafts) if rows else None

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


class DraftMasks:
    """Constrained requests' matchers run ahead over their drafts as the draft loop makes them.

    Each draft step's logits are masked by the state after the drafts so far (`apply`), so a draft
    is one the grammar allows; one it refuses all the same (no token allowed, or after the end)
    ends its request's drafts there (`advance`), and a draft that ends the grammar is its last.
    `rollback` returns every matcher to the state before the loop: only accepted tokens advance it."""

    def __init__(self, grammar: StructuredOutput, matchers: list[xgr.GrammarMatcher], rows: list[int],
                 num_drafts: Sequence[int]):
        self.grammar = grammar
        self.matchers = matchers
        self.rows = rows
        self.lengths = list(num_drafts)   # per item: the drafts it keeps (only constrained rows shrink)
        self._open = [num_drafts[r] > 0 for r in rows]
        self._ahead = [0] * len(rows)   # tokens each matcher accepted in this loop
        self._bitmask = grammar._scratch_bitmask(len(rows))
        self._row_index = np.asarray(rows, dtype=np.int64)

    def apply(self, logits: torch.Tensor) -> None:
        """In place: mask each open constrained item's row of one draft step's logits [items, V]
        (a closed one's drafts end before this step: its row is left as it is)."""
        live = [k for k, on in enumerate(self._open) if on]
        if not live:
            return
        self.grammar._batch.batch_fill_next_token_bitmask([self.matchers[k] for k in live], self._bitmask, live)
        values = RowValues()
        values.ids("rows", self._row_index[live])
        values.words("words", self._bitmask[live].numpy())
        dev = values.to(logits.device)
        apply_bitmask(logits, dev["rows"], dev["words"])

    def advance(self, step: int, tokens: list[int]) -> None:
        """Accept draft `step` (0-based) of every open constrained item (`tokens`: one per item)."""
        for k, row in enumerate(self.rows):
            if not self._open[k]:
                continue
            matcher = self.matchers[k]
            if matcher.is_terminated() or not matcher.accept_token(tokens[row]):
                self.lengths[row], self._open[k] = step, False
                continue
            self._ahead[k] += 1
            if matcher.is_terminated() or step + 1 >= self.lengths[row]:
                self.lengths[row], self._open[k] = step + 1, False

    def rollback(self) -> None:
        for k, matcher in enumerate(self.matchers):
            if self._ahead[k]:
                matcher.rollback(self._ahead[k])
            self._ahead[k] = 0
