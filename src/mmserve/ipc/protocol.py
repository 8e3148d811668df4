"""What crosses between the front end and the engine core, in both directions. Plain data only.

Front end -> core: `AddRequest`, `ExtendRequest`, `AbortRequests`, `UtilityCall`, `Shutdown`
(and `EngineDeadRead`, once it has read an `EngineDead`).
Core -> front end: `EngineReady` once (or `EngineDead`), then one `EngineCoreOutputs` per engine
iteration that changed anything (admissions, tokens, ends, a step record, utility results), and a
`Heartbeat` when its loop sent nothing for a second.
`mmserve.ipc.serial` serialises all of these generically: a field added to any of them (or to
EngineRequest, SamplingParams, StepRecord ...) crosses with no change here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from mmserve.ipc.kv_cache_events import KvEvent
from mmserve.ipc.records import StepRecord
from mmserve.request import EncoderInput
from mmserve.sampling_params import SamplingParams


@dataclass
class EngineCoreRequest:
    """A fully prepared prompt, as the engine core takes it: token ids with each image/frame's
    placeholder run as an inclusive absolute [start, end] range and its pixels in `mm_inputs`
    (same order). The front end's `EngineRequest` adds what never crosses."""

    request_id: str
    prompt_token_ids: list[int]
    mm_ranges: list[tuple[int, int]] = field(default_factory=list)
    mm_inputs: list[EncoderInput] = field(default_factory=list)   # pixels or audio features, one per range
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    owner: bytes = b""       # who sent it (server/in_flight.py caller_key): seats are shared fairly between owners
    num_frames: int = 0      # video frames in the prompt (images are not frames)
    num_mm_tokens: int = 0   # placeholder tokens over all images and frames
    fork_of: str | None = None   # sample i > 0 of request `fork_of` (engine/parallel_sampling.py)
    # > 0: a live session's context that may grow to this many tokens (AsyncEngine.extend); it never
    # samples, streams its progress (RequestOutput.prefilled_tokens) and ends only when aborted.
    open_prompt: int = 0
    # The live session a context belongs to: its contexts share one KV reservation (EngineCore).
    session_id: str = ""
    # A live question's context: the open prompt whose first len(mm_ranges) media (at the same
    # positions) this request's are. The core takes them from that prompt's own request, so they do
    # not cross again: `mm_inputs` stays empty in the core's copy (EngineRequest.core_request).
    context_request_id: str = ""


@dataclass(frozen=True)
class TokenLogprobs:
    """One position: the chosen token, its log-probability and 1-based rank (1 = most likely), and the
    `top` most likely tokens, best first."""

    token_id: int
    logprob: float
    rank: int
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class LoadInfo:
    running: int
    waiting: int
    kv_usage: float       # share of usable KV blocks in use, over all pools, in [0, 1]
    max_num_seqs: int
    kv_cached_usage: float = 0.0   # share of usable blocks free but holding cached prefixes (fullest pool)



@dataclass(frozen=True)
class CoreAddresses:
    """ipc endpoints in the front end's private (0700) directory. Each sending side connects (its
    messages queue until the peer is there); each receiving side binds."""

    inputs: str    # front end PUSH (connects) -> core PULL (binds)
    outputs: str   # core PUSH (connects) -> front end PULL (binds)

    @property
    def private_dir(self) -> str:
        """Their directory: the front end removes it when it stops, whatever became of the engine, so
        the engine's own files go there too (the tensor-parallel rendezvous) and never outlive a kill."""
        return os.path.dirname(self.inputs.removeprefix("ipc://"))


@dataclass
class AddRequest:
    request: EngineCoreRequest


@dataclass
class AbortRequests:
    """The front end has already ended these requests; the core frees them and acknowledges each
    (`EngineCoreOutputs.aborted`), so their id may be reused safely."""

    request_ids: list[str]


@dataclass
class ExtendRequest:
    """Append tokens (and the images/frames of their ranges, absolute positions) to an open prompt."""

    request_id: str
    token_ids: list[int]
    mm_ranges: list[tuple[int, int]] = field(default_factory=list)
    mm_inputs: list = field(default_factory=list)   # MultiModalInput, one per range


@dataclass
class UtilityCall:
    """Ask the core for something outside the step loop (`core_proc.UTILITIES` names what is allowed)."""

    call_id: int
    method: str
    args: tuple = ()


@dataclass
class Shutdown:
    """End every request still in flight (EngineUnavailableError) and exit."""


@dataclass
class CoreOutput:
    """One request's result of one engine iteration: new tokens, and how it ended if it did.

    `finish_reason` is "eos" or "length" (stop strings are the front end's business); `error` ends
    the request with that exception (admission refused, aborted, a failed step). `logprobs`: one per
    new token when the request asked; `prompt_logprobs` and `finish_detail` come with the end.
    `num_cached_tokens` (prompt tokens the prefix cache served at admission, -> Usage.cached_tokens)
    comes with every output that has tokens: the front end may end the request on any of them."""

    # the fields every step's output sets first: the engine builds one per request per step positionally
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    error: BaseException | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    finish_detail: str | None = None
    prefilled_tokens: int = 0   # an open prompt's computed tokens after this step (it never has new tokens)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class UtilityResult:
    call_id: int
    result: Any = None
    error: str | None = None


@dataclass
class EngineCoreOutputs:
    """Everything one engine iteration produced, in the order it happened: `aborted` acknowledges
    every requested abort (known or not), `admitted` lists requests queued (a refused one comes as an
    output with an error instead), then the step and its outputs. `load` is the state after it.
    `kv_events`: the prefix cache's key changes in this iteration (ipc/kv_cache_events.py)."""

    load: LoadInfo
    aborted: list[str] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    step: StepRecord | None = None
    outputs: list[CoreOutput] = field(default_factory=list)
    utility: list[UtilityResult] = field(default_factory=list)
    kv_events: list[KvEvent] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.aborted or self.admitted or self.step or self.outputs or self.utility or self.kv_events)


@dataclass(frozen=True)
class KvCapacity:
    """The KV cache as sized at start-up (core/kv_cache/planner.py), for logs, GetModelInfo and metrics."""

    pool_tokens: dict[str, int]    # tokens of K/V each pool holds (a windowed pool's are recycled as windows move)
    full_context_requests: int     # requests of max_model_len tokens it holds at once
    num_bytes: int                 # device memory the pools take
    max_num_seqs: int              # requests that run at once (lowered when the cache holds fewer windows)
    sized_by: str                  # what sized it: the memory profile, --kv-cache-bytes, --num-kv-blocks, a CPU's default

    def describe(self) -> str:
        tokens = ", ".join(f"{t} {n} tokens" for t, n in self.pool_tokens.items())
        return (f"{self.num_bytes / 2**20:.1f} MiB ({tokens}; {self.full_context_requests} full-context requests fit, "
                f"{self.max_num_seqs} run at once; {self.sized_by})")


@dataclass(frozen=True)
class EngineReady:
    """The handshake: what the front end needs before it can take requests."""

    model_name: str
    backend: str
    dtype: str
    max_model_len: int
    tokens_per_frame: int
    eos_token_ids: tuple[int, ...]
    kv_pool_blocks: dict[str, int]
    max_num_seqs: int
    peaks: Any              # metrics.peaks.DevicePeaks, measured in the engine process
    torch_threads: int
    pid: int
    backend_checks: tuple = ()   # engine.backend_check.BackendCheck: the start-up self-check's results
    kv_capacity: KvCapacity | None = None


@dataclass(frozen=True)
class EngineDead:
    """Sent by a core that is about to exit abnormally (startup failure, a bug in its loop). The core
    then waits for `EngineDeadRead` before it exits."""

    reason: str


@dataclass(frozen=True)
class EngineDeadRead:
    """The front end has read the core's `EngineDead`: the core may exit. Had it exited at once, the
    exit could be seen before its message arrived (on a loaded machine, by more than any fixed wait),
    and the front end would report an exit code without the reason."""


@dataclass(frozen=True)
class Heartbeat:
    """The core loop still turns: sent when it sent nothing else for `HEARTBEAT_S` (core/process.py), so
    the front end tells a core that is idle from one that is wedged (--engine-stall-timeout-s)."""
