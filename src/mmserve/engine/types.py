"""Plain data crossing the engine's edge: what the server submits and what it streams back."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mmserve.engine.routing_prompt import RoutingPrompt
from mmserve.metrics.peaks import DevicePeaks
from mmserve.request import EncoderInput
from mmserve.sample.logprobs import TokenLogprobs
from mmserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class SampledVideo:
    """The frames sampled from one video part (`part`: where it was in the request), for the Final."""

    part: str
    timestamps_s: tuple[float, ...]
    duration_s: float = 0.0


@dataclass
class EngineRequest:
    """A fully prepared prompt: token ids with each image/frame's placeholder run as an inclusive
    absolute [start, end] range and its pixels in `mm_inputs` (same order)."""

    request_id: str
    prompt_token_ids: list[int]
    mm_ranges: list[tuple[int, int]] = field(default_factory=list)
    mm_inputs: list[EncoderInput] = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    trace_context: Any = field(default=None, metadata={"local": True})   # front end only: never crosses
    num_frames: int = 0      # video frames in the prompt (images are not frames)
    num_mm_tokens: int = 0   # placeholder tokens over all images and frames
    fork_of: str | None = None   # sample i > 0 of request `fork_of` (engine/parallel_sampling.py)
    # The prompt as a gateway sent it, when that differs from ours (engine/kv_event_hub.py): front end only.
    routing_prompt: RoutingPrompt | None = field(default=None, metadata={"local": True})
    # Front end only (never cross): when the server received it (timings count from here, so TTFT
    # includes decoding its media), how long input processing took, what each video sampled, and
    # whether the observer sees it (the warm-up request is in no metric).
    arrival_time: float | None = field(default=None, metadata={"local": True})
    preprocess_s: float = field(default=0.0, metadata={"local": True})
    videos: list[SampledVideo] = field(default_factory=list, metadata={"local": True})
    observed: bool = field(default=True, metadata={"local": True})


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    multimodal_tokens: int
    completion_tokens: int
    num_frames: int
    cached_tokens: int = 0   # prompt tokens whose K/V came from the prefix cache (not computed)


@dataclass(frozen=True)
class Timings:
    """Seconds from arrival: to the first schedule, to the first token, to now, and the part of it
    spent decoding and preparing the inputs (the wire's names)."""

    queue_s: float | None = None
    time_to_first_token_s: float | None = None
    end_to_end_s: float | None = None
    preprocess_s: float | None = None


@dataclass
class RequestOutput:
    """One streamed delta. Exactly one output per request has finished=True, and it is the last."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprobs] | None = None   # one per new token, when the request asked
    finished: bool = False
    finish_reason: str | None = None   # "length" | "eos" | "stop"; None while running
    matched_stop: str | None = None
    finish_detail: str | None = None   # why it finished, in words, when finish_reason says too little
    prompt_logprobs: list[TokenLogprobs] | None = None   # on the last output, when the request asked
    usage: Usage | None = None
    timings: Timings | None = None
    perf: dict[str, Any] = field(default_factory=dict)
    videos: list[SampledVideo] | None = None   # on the last output: each video part's sampled frames

    def merged(self, later: RequestOutput) -> RequestOutput:
        """This delta followed by `later`, as one (a reader that lagged gets one message): list
        fields and `new_text` concatenate, every other field is the later output's."""
        values = {}
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(later, f.name)
            values[f.name] = a + b if (isinstance(a, list) and isinstance(b, list)) or f.name == "new_text" else b
        return RequestOutput(**values)


@dataclass(frozen=True)
class LoadInfo:
    running: int
    waiting: int
    kv_usage: float       # share of usable KV blocks in use, over all pools, in [0, 1]
    max_num_seqs: int
    kv_cached_usage: float = 0.0   # share of usable blocks free but holding cached prefixes (fullest pool)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    context_length: int
    tokens_per_frame: int
    backend: str
    dtype: str
    peaks: DevicePeaks | None = None   # what MFU/MBU divide by
    backend_checks: tuple = ()         # engine.backend_check.BackendCheck per checked component
