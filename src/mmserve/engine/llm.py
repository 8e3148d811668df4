"""Offline generation for scripts and tests: the same EngineCore and OutputProcessor as the server,
with the core stepped in-process on the caller's thread (no engine process, no IPC)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from mmserve.config import EngineConfig
from mmserve.core.engine_core import EngineCore, load_engine_model
from mmserve.engine.output.processor import OutputProcessor
from mmserve.engine.parallel_sampling import fan_out
from mmserve.engine.types import EngineRequest, Timings, Usage
from mmserve.ipc.protocol import TokenLogprobs
from mmserve.sampling_params import SamplingParams


@dataclass
class Completion:
    """A whole request's result (the streamed deltas joined)."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    matched_stop: str | None
    usage: Usage | None
    timings: Timings | None
    logprobs: list[TokenLogprobs] | None = None   # per token, when the request asked for them
    prompt_logprobs: list[TokenLogprobs] | None = None   # entry j: prompt token j + 1, when asked
    finish_detail: str | None = None
    samples: list[Completion] | None = None   # with sampling n > 1: every sample, this one first


class LLM:
    """`LLM(model=path, max_num_batched_tokens=64, ...)`: engine options are EngineConfig fields."""

    def __init__(self, model: str | None = None, *, loaded_model=None, tokenizer=None, observer=None,
                 **engine_options):
        if model is not None:
            engine_options["model"] = model
        names = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = set(engine_options) - names
        if unknown:
            raise TypeError(f"unknown engine options {sorted(unknown)}")
        self.config = EngineConfig(**engine_options)
        if self.config.tensor_parallel_size > 1:
            raise ValueError("tensor_parallel_size > 1 runs in the server's engine process (mmserve serve); "
                             "the offline LLM steps one device in the caller's process")
        if loaded_model is None:
            loaded_model, tokenizer = load_engine_model(self.config)
        self.core = EngineCore(self.config, model=loaded_model, tokenizer=tokenizer)
        self.processor = OutputProcessor(tokenizer, observer)
        self.processor.engine_started(self.core.peaks, tuple(self.core.runner.backend_checks))
        self._ids = itertools.count()

    def generate(self, requests: Sequence[EngineRequest | list[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Completion]:
        """Run all requests to completion together; results in input order. If any request fails,
        the others still run to the end, then the first error is raised. A plain token-id list
        is a text-only prompt; `sampling` (one, or one per request) overrides each EngineRequest's own."""
        if isinstance(sampling, SamplingParams) or sampling is None:
            sampling = [sampling] * len(requests)
        reqs = []
        for r, sp in zip(requests, sampling, strict=True):
            if not isinstance(r, EngineRequest):
                r = EngineRequest(f"llm-{next(self._ids)}", list(r))
            if sp is not None:
                r = dataclasses.replace(r, sampling=sp)
            reqs.append(r)
        expanded = [sub for r in reqs for sub in fan_out(r)]
        done: dict[str, Completion] = {r.request_id: Completion(r.request_id, [], "", None, None, None, None)
                                       for r in expanded}
        for r in expanded:
            self.add_request(r)
        remaining, errors = len(expanded), []
        while remaining:
            for rid, item in self.step():
                if isinstance(item, BaseException):   # finish the others first, so the engine ends clean
                    errors.append(item)
                    remaining -= 1
                    continue
                c = done[rid]
                c.token_ids += item.new_token_ids
                c.text += item.new_text
                if item.new_logprobs is not None:
                    c.logprobs = (c.logprobs or []) + item.new_logprobs
                if item.finished:
                    remaining -= 1
                    c.finish_reason, c.matched_stop = item.finish_reason, item.matched_stop
                    c.usage, c.timings = item.usage, item.timings
                    c.prompt_logprobs, c.finish_detail = item.prompt_logprobs, item.finish_detail
        if errors:
            raise errors[0]
        for r in reqs:
            if r.sampling.n > 1:
                done[r.request_id].samples = [done[sub.request_id] for sub in fan_out(r)]
        return [done[r.request_id] for r in reqs]

    @property
    def observer(self):
        return self.processor.observer

    @observer.setter
    def observer(self, observer) -> None:
        self.processor.observer = observer
        self.processor.engine_started(self.core.peaks, tuple(self.core.runner.backend_checks))

    def add_request(self, request: EngineRequest) -> None:
        """Queue one request (raises admission errors at once, before anything is queued)."""
        self.processor.add(request)
        try:
            self.core.add_request(request.core_request())
        except BaseException:
            self.processor.forget(request.request_id)
            raise

    @property
    def has_work(self) -> bool:
        return bool(self.processor.states) or self.core.has_work

    def step(self) -> list:
        """One engine step; returns (request_id, RequestOutput | error) per request that moved."""
        done = self.processor.process(self.core.step())
        for rid in done.stopped:
            self.core.abort(rid)
        return done.events
