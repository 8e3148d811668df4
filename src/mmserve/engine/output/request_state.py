"""The front end's per-request bookkeeping: detokenized text, stop strings, timings, stream deltas.

`request` is the front end's own `Request` (prompt, ranges, pixels, output ids, perf): what the
observer reads, mirrored from the core's outputs, so observing never needs the engine process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from mmserve.engine.output.stopping import check_stop
from mmserve.engine.types import RequestOutput, SampledVideo, Timings, Usage
from mmserve.ipc.protocol import CoreOutput, TokenLogprobs
from mmserve.request import Request

NO_EOS: frozenset[int] = frozenset()   # the core ends requests on EOS; the front end looks for stop strings


@dataclass
class RequestState:
    request: Request
    num_frames: int
    detokenizer: object | None       # IncrementalDetokenizer, or None for a checkpoint without tokenizer
    preprocess_s: float = 0.0        # input processing, counted in every timing (arrival is before it)
    videos: list[SampledVideo] = field(default_factory=list)
    observed: bool = True            # False: the observer never hears of it (the warm-up request)
    admitted: bool = False           # the core queued it (observer hooks run only for admitted requests)
    text: str = ""
    emitted_chars: int = 0
    emitted_tokens: int = 0
    first_scheduled: float | None = None
    first_token: float | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)   # per output token, when asked for

    def timings(self, now: float) -> Timings:
        arrival = self.request.arrival_time
        return Timings(
            queue_s=None if self.first_scheduled is None else self.first_scheduled - arrival,
            time_to_first_token_s=None if self.first_token is None else self.first_token - arrival,
            end_to_end_s=now - arrival, preprocess_s=self.preprocess_s)

    def usage(self) -> Usage:
        r = self.request
        return Usage(prompt_tokens=r.num_prompt_tokens, multimodal_tokens=r.num_mm_tokens,
                     completion_tokens=len(r.output_token_ids), num_frames=self.num_frames,
                     cached_tokens=r.num_cached_tokens)

    def append(self, out: CoreOutput) -> RequestOutput:
        """Record the core's new tokens (and logprobs); return the delta to stream. The core decides
        "eos" and "length" (`out.finish_reason`); stop strings are found here and take precedence."""
        r = self.request
        token_ids, engine_finish = out.new_token_ids, out.finish_reason
        r.num_cached_tokens = out.num_cached_tokens   # only the core sees the prefix cache
        params = r.sampling_params
        before_step = len(r.output_token_ids)
        longest_stop = max((len(s) for s in params.stop), default=0)
        decision = None
        for token_id in token_ids:
            r.output_token_ids.append(token_id)
            before = len(self.text)
            if self.detokenizer is not None:
                self.text += self.detokenizer.push([token_id])
            decision = check_stop(params, token_id, len(r.output_token_ids), self.text,
                                  max(0, before - longest_stop + 1), NO_EOS)
            if decision.finish_reason is not None:
                break
        if out.logprobs:   # the kept tokens': a stop string inside a step of several (accepted drafts) drops the rest
            self.logprobs += out.logprobs[:len(r.output_token_ids) - before_step]
        reason = decision.finish_reason if decision and decision.finish_reason else engine_finish
        visible = decision.visible_len if decision else len(self.text)
        if reason is not None and reason != "stop":
            if self.detokenizer is not None:
                self.text += self.detokenizer.flush()
            visible = len(self.text)
        if reason == "stop":
            self.text = self.text[:visible]
        new_text = self.text[self.emitted_chars:max(self.emitted_chars, visible)]
        self.emitted_chars += len(new_text)
        new_tokens = r.output_token_ids[self.emitted_tokens:]
        new_logprobs = self.logprobs[self.emitted_tokens:] if r.sampling_params.logprobs else None
        self.emitted_tokens = len(r.output_token_ids)
        finished = reason is not None
        return RequestOutput(
            request_id=r.request_id, new_token_ids=new_tokens, new_text=new_text, new_logprobs=new_logprobs,
            finished=finished, finish_reason=reason, prefilled_tokens=out.prefilled_tokens,
            matched_stop=decision.matched_stop if reason == "stop" else None,
            finish_detail=out.finish_detail if finished and reason == engine_finish else None,
            usage=self.usage() if finished else None, timings=self.timings(time.monotonic()) if finished else None,
            perf=r.perf if finished else {}, videos=list(self.videos) if finished else None,
            prompt_logprobs=(out.prompt_logprobs or []) if finished and r.sampling_params.prompt_logprobs else None)
