"""The front end's request and what it streams back (what crosses to the core: ipc/protocol.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mmserve.engine.routing_prompt import RoutingPrompt
from mmserve.ipc.protocol import EngineCoreRequest, TokenLogprobs
from mmserve.metrics.peaks import DevicePeaks

# The ids the server derives from a client's id: a parallel sample's ("x#1"), a live session's
# contexts ("x#context-0") and questions ("x#q-<question id>"). No client id may hold the separator
# (server/in_flight.py refuses it at both doors), so no client can name, squat or abort them.
DERIVED_ID_SEPARATOR = "#"


def derived_id(client_id: str, suffix: str) -> str:
    return f"{client_id}{DERIVED_ID_SEPARATOR}{suffix}"


@dataclass(frozen=True)
class SampledVideo:
    """The frames sampled from one video part (`part`: where it was in the request), for the Final."""

    part: str
    timestamps_s: tuple[float, ...]
    duration_s: float = 0.0


@dataclass
class EngineRequest(EngineCoreRequest):
    """The front end's request: what crosses to the engine core (`EngineCoreRequest`, sent as
    `core_request()`) plus what only the front end keeps: the trace context, the gateway's view of
    the prompt (engine/kv_event_hub.py), when the server received it (timings count from there, so
    TTFT includes decoding its media), how long input processing took, what each video sampled,
    how many of `mm_ranges` each media part became (a gateway's anchors are mapped onto ours with
    it) and whether the observer sees it (the warm-up request is in no metric)."""

    trace_context: Any = None
    routing_prompt: RoutingPrompt | None = None
    arrival_time: float | None = None
    preprocess_s: float = 0.0
    videos: list[SampledVideo] = field(default_factory=list)
    ranges_per_part: dict[str, int] = field(default_factory=dict)
    observed: bool = True

    def core_request(self) -> EngineCoreRequest:
        """What crosses to the core: a live question's media stay behind (its context holds them)."""
        core = EngineCoreRequest(**{f.name: getattr(self, f.name) for f in dataclasses.fields(EngineCoreRequest)})
        if core.context_request_id:
            core.mm_inputs = []
        return core


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
    prefilled_tokens: int = 0   # an open prompt's tokens in the KV cache, after the step that computed them

    def merged(self, later: RequestOutput) -> RequestOutput:
        """This delta followed by `later`, as one (a reader that lagged gets one message): list
        fields and `new_text` concatenate, every other field is the later output's."""
        values = {}
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(later, f.name)
            values[f.name] = a + b if (isinstance(a, list) and isinstance(b, list)) or f.name == "new_text" else b
        return RequestOutput(**values)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    context_length: int
    tokens_per_frame: int
    backend: str
    dtype: str
    peaks: DevicePeaks | None = None   # what MFU/MBU divide by
    backend_checks: tuple = ()         # engine.backend_check.BackendCheck per checked component
    kv_capacity: Any = None            # ipc.protocol.KvCapacity: the KV cache as sized at start-up
