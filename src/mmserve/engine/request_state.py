"""The engine's per-request bookkeeping: detokenized text, stop handling, timings, stream deltas."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from mmserve.engine.logprobs import TokenLogprobs
from mmserve.engine.stopping import check_stop
from mmserve.engine.types import RequestOutput, Timings, Usage
from mmserve.scheduler.request import Request


@dataclass
class RequestState:
    request: Request
    num_frames: int
    detokenizer: object | None       # IncrementalDetokenizer, or None for a checkpoint without tokenizer
    text: str = ""
    emitted_chars: int = 0
    emitted_tokens: int = 0
    first_scheduled: float | None = None
    first_token: float | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)   # per output token, when asked for
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)   # entry j: prompt token j + 1

    def timings(self, now: float) -> Timings:
        arrival = self.request.arrival_time
        return Timings(
            queue_s=None if self.first_scheduled is None else self.first_scheduled - arrival,
            time_to_first_token_s=None if self.first_token is None else self.first_token - arrival,
            end_to_end_s=now - arrival)

    def usage(self) -> Usage:
        r = self.request
        return Usage(prompt_tokens=r.num_prompt_tokens, multimodal_tokens=r.num_mm_tokens,
                     completion_tokens=len(r.output_token_ids), num_frames=self.num_frames,
                     cached_tokens=r.num_cached_tokens)

    def append(self, token_id: int, eos_token_ids: frozenset[int],
               logprobs: TokenLogprobs | None = None) -> RequestOutput:
        """Record a sampled token (already in request.output_token_ids) and its logprobs when the
        request asked for them; return the delta to stream."""
        r = self.request
        if logprobs is not None:
            self.logprobs.append(logprobs)
        before = len(self.text)
        if self.detokenizer is not None:
            self.text += self.detokenizer.push([token_id])
        longest_stop = max((len(s) for s in r.sampling_params.stop), default=0)
        decision = check_stop(r.sampling_params, token_id, len(r.output_token_ids), self.text,
                              max(0, before - longest_stop + 1), eos_token_ids)
        finished = decision.finish_reason is not None
        if finished and decision.finish_reason != "stop" and self.detokenizer is not None:
            self.text += self.detokenizer.flush()
            decision_len = len(self.text)
        else:
            decision_len = decision.visible_len
        if decision.finish_reason == "stop":
            self.text = self.text[:decision_len]
        new_text = self.text[self.emitted_chars:max(self.emitted_chars, decision_len)]
        self.emitted_chars += len(new_text)
        new_tokens = r.output_token_ids[self.emitted_tokens:]
        new_logprobs = self.logprobs[self.emitted_tokens:] if r.sampling_params.logprobs else None
        self.emitted_tokens = len(r.output_token_ids)
        now = time.monotonic()
        return RequestOutput(
            request_id=r.request_id, new_token_ids=new_tokens, new_text=new_text, new_logprobs=new_logprobs,
            finished=finished,
            finish_reason=decision.finish_reason, matched_stop=decision.matched_stop,
            usage=self.usage() if finished else None, timings=self.timings(now) if finished else None,
            perf=r.perf if finished else {},
            prompt_logprobs=self.prompt_logprobs if finished and r.sampling_params.prompt_logprobs else None)
