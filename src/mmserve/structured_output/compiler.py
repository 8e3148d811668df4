"""Compiling response formats (JSON schema, regex, EBNF) off every loop, once per spec.

A compile can take seconds (nesting and property counts grow it fast), so it never runs on the
front end's event loop or the engine's step loop: one worker thread per process does it (xgrammar
releases the GIL while compiling). Each process keeps its own LRU keyed by a hash of (kind, spec),
bounded in bytes: the front end compiles to validate (a spec that fails, matches nothing or takes
longer than the time limit is refused before admission), the engine compiles again for its masks.
Verdicts are cached too, so a refused spec costs one compile, however often it is sent; a spec
over the time limit stays refused even after its compile finishes. A compile cannot be stopped once
it runs, but one still queued when everyone waiting for it has given up is skipped: a burst of slow
specs costs the worker the one it is running, not the whole queue.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import re
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from mmserve.errors import InvalidInputError, LimitExceededError
from mmserve.sampling_params import ResponseFormat

if TYPE_CHECKING:
    import xgrammar as xgr

ERROR_BYTES = 256   # what a cached refusal counts against the byte budget
COMPILE_NICENESS = 5   # added to the compile thread's nice value: background work beside the step loop


def field_name(fmt: ResponseFormat) -> str:
    return f"sampling.response_format.{fmt.kind}"


def spec_key(fmt: ResponseFormat) -> str:
    return hashlib.sha256(f"{fmt.kind}\0{fmt.spec}".encode()).hexdigest()


def _reason(error: Exception) -> str:
    """xgrammar's message without its C++ log prefix ("[12:00:00] /project/cpp/x.cc:12: ")."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(error)).strip()


class FormatCompiler:
    """Compiled grammars for one tokenizer. `submit` is safe from any thread; the tokenizer's
    xgrammar view is built lazily on the worker (it walks the whole vocabulary)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int], *, cache_bytes: int,
                 timeout_s: float):
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self._tokenizer = tokenizer
        self._eos = list(eos_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        self._cache_bytes = cache_bytes
        self._cache: OrderedDict[str, tuple[xgr.CompiledGrammar | InvalidInputError, int]] = OrderedDict()
        self._bytes = 0
        self._pending: dict[str, Future] = {}
        self._wanted_until: dict[str, float] = {}   # pending key -> when its last waiter gives up (monotonic)
        self._running: set[str] = set()
        self._lock = threading.Lock()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="format-compile", initializer=_background)
        self.compiles = 0   # compiles really run (cache misses): what tests count to see the cache work

    def cached(self, fmt: ResponseFormat) -> xgr.CompiledGrammar | None:
        """The compiled grammar if it is cached (raises its refusal if that is), else None."""
        with self._lock:
            hit = self._cache.get(spec_key(fmt))
            if hit is None:
                return None
            self._cache.move_to_end(spec_key(fmt))
        return _unwrap(hit[0])

    def submit(self, fmt: ResponseFormat) -> Future:
        """A future of the compiled grammar (InvalidInputError when refused); one compile per spec
        however many requests wait for it."""
        key = spec_key(fmt)
        with self._lock:
            if (hit := self._cache.get(key)) is not None:
                self._cache.move_to_end(key)
                done: Future = Future()
                _settle(done, hit[0])
                return done
            self._wanted_until[key] = max(self._wanted_until.get(key, 0.0), time.monotonic() + self.timeout_s)
            if (pending := self._pending.get(key)) is None:
                pending = self._pending[key] = self._worker.submit(self._compile, key, fmt)
            return pending

    async def check(self, fmt: ResponseFormat) -> None:
        """The front end's check, awaited off the event loop: raises InvalidInputError when the spec
        is malformed, matches nothing, or does not compile within the time limit; LimitExceededError
        (retryable) when the time ran out before the worker got to it."""
        compiled = asyncio.wrap_future(self.submit(fmt))
        try:
            await asyncio.wait_for(asyncio.shield(compiled), self.timeout_s)   # shielded: others may wait for it
        except TimeoutError:
            with self._lock:
                started = spec_key(fmt) in self._running
            if not started:
                raise LimitExceededError(f"the response_format compile worker is busy with other formats: "
                                         f"{field_name(fmt)} was not compiled within {self.timeout_s:g} s",
                                         "--grammar-compile-timeout-s", retryable=True) from None
            raise self._too_slow(fmt) from None
        finally:
            if not compiled.done():   # timed out or cancelled: nobody awaits it now, so no "never retrieved"
                compiled.add_done_callback(_retrieve)

    def compile(self, fmt: ResponseFormat) -> xgr.CompiledGrammar:
        """Blocking: wait for `submit`'s result (the offline engine, tests)."""
        return self.submit(fmt).result()

    def shutdown(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    # -- the worker ------------------------------------------------------------------------------

    def _compile(self, key: str, fmt: ResponseFormat) -> xgr.CompiledGrammar:
        with self._lock:
            if time.monotonic() > self._wanted_until.pop(key, math.inf):   # nobody waits any more
                del self._pending[key]
                raise LimitExceededError("skipped: every request waiting for this compile gave up", retryable=True)
            self._running.add(key)
        start = time.perf_counter()
        try:
            result: xgr.CompiledGrammar | InvalidInputError = self._build(fmt)
            if time.perf_counter() - start > self.timeout_s:
                result = self._too_slow(fmt)
        except InvalidInputError as e:
            result = e
        except BaseException:
            with self._lock:
                self._pending.pop(key, None)
                self._running.discard(key)
            raise
        with self._lock:
            self.compiles += 1
            self._store(key, result)
            self._pending.pop(key, None)
            self._running.discard(key)
            self._wanted_until.pop(key, None)   # waiters that came while it ran
        return _unwrap(result)

    def _build(self, fmt: ResponseFormat) -> xgr.CompiledGrammar:
        # xgrammar (~0.1 s of CPU) loads at the first compile: the front end imports this module at
        # start and may never compile. A missing xgrammar still fails `serve`'s start: the engine
        # process imports it as it starts (structured_output.manager).
        import xgrammar as xgr

        from mmserve.structured_output.grammar_check import dead_rules
        from mmserve.structured_output.json_strings import json_safe_strings

        compiler = self._xgrammar()
        try:
            if fmt.kind == "json_schema":
                grammar = json_safe_strings(xgr.Grammar.from_json_schema(fmt.spec, any_whitespace=False,
                                                                         separators=(",", ":")))
            elif fmt.kind == "regex":
                grammar = xgr.Grammar.from_regex(fmt.spec)
            else:
                grammar = xgr.Grammar.from_ebnf(fmt.spec)
        except (RuntimeError, ValueError) as e:   # xgrammar raises RuntimeError subclasses with the parser's message
            raise InvalidInputError(field_name(fmt), _reason(e)) from None
        if dead := dead_rules(grammar):
            raise InvalidInputError(field_name(fmt), f"{'matches nothing: ' if dead[0] == 'root' else ''}"
                                    f"rule{'s' * (len(dead) > 1)} {', '.join(dead[:5])} can never finish (each alternative needs itself, "
                                    "another rule that cannot finish, or an empty character class)")
        compiled = compiler.compile_grammar(grammar)
        if not self._admits_a_token(compiled):
            raise InvalidInputError(field_name(fmt), "matches nothing: no output can satisfy it (not even an empty "
                                    "one); check for empty character classes")
        return compiled

    def _admits_a_token(self, compiled: xgr.CompiledGrammar) -> bool:
        """Whether any first token (the stop token included, for an empty match) is allowed."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
        return bool(bitmask.any())

    def _xgrammar(self) -> xgr.GrammarCompiler:
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import PreTrainedTokenizerFast

            hf = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer.backend)
            info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size, stop_token_ids=self._eos)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def _too_slow(self, fmt: ResponseFormat) -> InvalidInputError:
        return InvalidInputError(field_name(fmt), f"did not compile within {self.timeout_s:g} s "
                                 "(--grammar-compile-timeout-s): simplify it (fewer properties, less nesting)")

    def _store(self, key: str, result) -> None:
        size = ERROR_BYTES if isinstance(result, InvalidInputError) else result.memory_size_bytes
        if size > self._cache_bytes:
            return
        self._cache[key] = (result, size)
        self._bytes += size
        while self._bytes > self._cache_bytes:
            _, (_, evicted) = self._cache.popitem(last=False)
            self._bytes -= evicted


def _background() -> None:
    """Lower the compile thread's CPU priority (Linux: per thread): on a machine the engine's torch
    threads already fill, a compile takes the cores they leave idle instead of slowing every step
    (a new format waits, running streams do not)."""
    if sys.platform == "linux":
        try:
            thread = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + COMPILE_NICENESS))
        except OSError:
            pass


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def _unwrap(result):
    if isinstance(result, InvalidInputError):
        raise InvalidInputError(result.field, str(result).removeprefix(f"{result.field}: "))
    return result


def _settle(future: Future, result) -> None:
    if isinstance(result, InvalidInputError):
        future.set_exception(InvalidInputError(result.field, str(result).removeprefix(f"{result.field}: ")))
    else:
        future.set_result(result)
