"""Structured output: token masks that keep a request's output inside a JSON schema, regex or grammar.

xgrammar does the work (chosen over llguidance by per-token mask time on this model's tokenizer,
docs/benchmarks.md). A grammar is compiled once per hash of (kind, spec) and kept in an LRU; each
request gets its own matcher. Per step, every constrained row's allowed-token bitmask is filled
on the host in one batched call, before anything waits on the device, so on a GPU it runs while
the forward pass is still executing; the mask is then applied to all rows at once on the device.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch
import xgrammar as xgr

from mmserve.engine.sampling_params import ResponseFormat
from mmserve.errors import InvalidInputError

DEFAULT_CACHE_SIZE = 256   # compiled grammars kept


def _field(fmt: ResponseFormat) -> str:
    return f"sampling.response_format.{fmt.kind}"


def _reason(error: Exception) -> str:
    """xgrammar's message without its C++ log prefix ("[12:00:00] /project/cpp/x.cc:12: ")."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(error)).strip()


def check_format(fmt: ResponseFormat) -> None:
    """Parse the schema, regex or grammar without a tokenizer (cheap): the edge's check, so a bad
    one is INVALID_ARGUMENT before the request is admitted."""
    try:
        if fmt.kind == "json_schema":
            try:
                schema = json.loads(fmt.spec)
            except ValueError as e:
                raise ValueError(f"not valid JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError("a JSON schema is an object (or true/false)")
            xgr.Grammar.from_json_schema(fmt.spec)
        elif fmt.kind == "regex":
            xgr.Grammar.from_regex(fmt.spec)
        else:
            xgr.Grammar.from_ebnf(fmt.spec)
    except (RuntimeError, ValueError) as e:   # xgrammar raises RuntimeError subclasses with the parser's message
        raise InvalidInputError(_field(fmt), _reason(e)) from None


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf wherever bit t of bitmask[i] (int32 words) is 0."""
    words = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(words.shape[0], -1)[:, :logits.shape[1]].bool()
    rows = rows.to(logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


class StructuredOutput:
    """Compiled grammars (LRU by hash), one matcher per constrained request, and the step's masks."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int], *,
                 cache_size: int = DEFAULT_CACHE_SIZE):
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()     # admission may compile on several threads
        self._matchers: dict[str, xgr.GrammarMatcher] = {}
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        self._bitmask = xgr.allocate_token_bitmask(8, vocab_size)
        self.vocab_size = vocab_size
        self.compiles = 0                 # cache misses, for tests and metrics

    # -- admission (any thread) ----------------------------------------------------------------------

    def compile(self, fmt: ResponseFormat) -> xgr.CompiledGrammar:
        key = hashlib.sha256(f"{fmt.kind}\0{fmt.spec}".encode()).hexdigest()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        try:
            if fmt.kind == "json_schema":
                compiled = self._compiler.compile_json_schema(fmt.spec, any_whitespace=False, separators=(",", ":"))
            elif fmt.kind == "regex":
                compiled = self._compiler.compile_regex(fmt.spec)
            else:
                compiled = self._compiler.compile_grammar(fmt.spec)
        except (RuntimeError, ValueError) as e:
            raise InvalidInputError(_field(fmt), _reason(e)) from None
        with self._lock:
            self.compiles += 1
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, fmt: ResponseFormat) -> xgr.GrammarMatcher:
        """A fresh matcher for `fmt` (compiling on a cache miss); raises InvalidInputError."""
        return xgr.GrammarMatcher(self.compile(fmt))

    def add(self, request_id: str, matcher: xgr.GrammarMatcher) -> None:
        self._matchers[request_id] = matcher

    # -- engine core, once per step --------------------------------------------------------------

    def fill(self, requests: Sequence) -> tuple[list[int], torch.Tensor] | None:
        """Host side of a step: the rows that are constrained and their bitmasks (None if none are)."""
        rows = [i for i, r in enumerate(requests) if r.request_id in self._matchers]
        if not rows:
            return None
        if self._bitmask.shape[0] < len(rows):
            self._bitmask = xgr.allocate_token_bitmask(2 * len(rows), self.vocab_size)
        bitmask = self._bitmask[:len(rows)]
        self._batch.batch_fill_next_token_bitmask([self._matchers[requests[i].request_id] for i in rows], bitmask)
        return rows, bitmask

    def accept(self, requests: Sequence, tokens: Sequence[int]) -> None:
        """Advance every constrained row's matcher past its sampled token."""
        for r, t in zip(requests, tokens, strict=True):
            matcher = self._matchers.get(r.request_id)
            if matcher is not None and not matcher.is_terminated() and not matcher.accept_token(t):
                # cannot happen with the mask applied; a bug if it does, so say which request
                raise RuntimeError(f"request {r.request_id}: token {t} breaks its response_format")

    def is_complete(self, request_id: str) -> bool:
        """True unless the request is constrained and its output so far is not a whole match."""
        matcher = self._matchers.get(request_id)
        return matcher is None or matcher.is_completed() or matcher.is_terminated()

    def free(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
