"""A request's state as the scheduler sees it. The scheduler owns the lifecycle; the engine reads it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mmserve.multimodal.content_hash import audio_content_hash, content_hash

if TYPE_CHECKING:  # the engine owns sampling; the scheduler only carries the object
    from mmserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class MultiModalInput:
    """One image or video frame, patchified: the vision tower's input for one placeholder range.
    `content_hash` names it for the prefix and encoder caches; computed here when not given, so
    the input processor makes these in its worker pool and hashing never runs on the event loop."""

    pixel_values: torch.Tensor   # [P, 3 * patch_size**2]
    position_ids: torch.Tensor   # [P, 2]; padding patches at (-1, -1)
    content_hash: bytes = b""

    def __post_init__(self) -> None:
        if not self.content_hash:
            self.content_hash = content_hash(self.pixel_values, self.position_ids)


@dataclass
class AudioFeatures:
    """One audio segment (at most the processor's 750 soft tokens, 30 s): the audio tower's input for
    one placeholder range. Its soft tokens attend causally in the decoder, so unlike an image's a
    range of them may be split between prefill chunks; the tower still runs on the whole segment,
    once, and each chunk takes its rows (worker/model_runner.py)."""

    features: torch.Tensor   # [mel frames, bins] log-mel, real frames only
    content_hash: bytes = b""

    def __post_init__(self) -> None:
        if not self.content_hash:
            self.content_hash = audio_content_hash(self.features)


EncoderInput = MultiModalInput | AudioFeatures


@dataclass(eq=False)
class Request:
    """`mm_ranges` are inclusive absolute [start, end] placeholder runs, sorted and disjoint;
    `mm_inputs[i]` is the encoder input of `mm_ranges[i]` (pixels, or an audio segment's features).
    A higher `priority` runs first."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    mm_ranges: list[tuple[int, int]] = field(default_factory=list)
    mm_inputs: list[EncoderInput] = field(default_factory=list)
    priority: int = 0
    # The client's key (a digest of its credentials, never the credentials; "" where the door knows no
    # caller): the scheduler shares seats between owners fairly (core/sched/fair_share.py).
    owner: bytes = b""
    arrival_time: float = field(default_factory=time.monotonic)
    trace_context: Any = None
    fork_of: str | None = None   # another sample of this request's prompt: admit on its KV blocks
    # A live session's context (engine/live_session.py): its prompt grows (`extend_prompt`) up to this
    # many tokens, it never samples and never ends by itself; 0 = an ordinary request.
    open_prompt: int = 0
    preprocess_s: float = 0.0    # the front end's input processing, inside arrival_time's count (observers)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0   # prompt tokens whose KV came from the prefix cache at first admission
    block_hashes: list[bytes] = field(default_factory=list, repr=False)   # prefix-cache key per full block
    # Speculative decoding: tokens the drafter proposes after the last one, for the next step to verify
    # (set by the engine after each step; the scheduler schedules them with the last token, or some or
    # none when the budget or KV is short, and drops them on preemption).
    draft_token_ids: list[int] = field(default_factory=list)
    # Async scheduling: tokens sampled by steps whose results have not reached the host yet. The
    # scheduler counts them as the request's next tokens (the next step computes them, its runner
    # taking their ids on the device); the engine replaces each with its id as the step's result lands.
    num_output_placeholders: int = 0
    # Observers (metrics, tracing) accumulate per-request numbers here; the engine never reads it.
    perf: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.mm_inputs) not in (0, len(self.mm_ranges)):
            raise ValueError(f"{self.request_id}: {len(self.mm_inputs)} mm inputs for {len(self.mm_ranges)} ranges")
        self._index_ranges()

    def _index_ranges(self) -> None:
        # [K, 2] int64 so the metadata builder can clip ranges with numpy instead of Python loops.
        self.mm_ranges_np = np.asarray(self.mm_ranges, dtype=np.int64).reshape(-1, 2)
        # The image/frame ranges: each attends within itself (bidirectional layers) and is never split
        # between chunks. Audio ranges are causal and may be.
        audio = np.asarray([isinstance(m, AudioFeatures) for m in self.mm_inputs], dtype=bool)
        self.mm_is_audio = audio   # per range when the inputs are here (empty without: every range a frame)
        self.vision_ranges_np = self.mm_ranges_np[~audio] if audio.any() else self.mm_ranges_np

    def extend_prompt(self, token_ids: list[int], mm_ranges: list[tuple[int, int]],
                      mm_inputs: list[MultiModalInput]) -> None:
        """Append to an open prompt (ranges absolute, after every earlier one). Block keys already
        computed stay valid: a key names its block's tokens and the items overlapping it, and only
        whole blocks of known tokens are ever keyed."""
        self.prompt_token_ids.extend(token_ids)
        self.mm_ranges.extend(mm_ranges)
        self.mm_inputs.extend(mm_inputs)
        self._index_ranges()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_mm_tokens(self) -> int:
        return int((self.mm_ranges_np[:, 1] - self.mm_ranges_np[:, 0] + 1).sum())

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end) of prompt + output, without concatenating the whole sequence."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    def token_at(self, pos: int) -> int:
        """The token at position `pos` of prompt + output (a decode's one input: no list made)."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[pos] if pos < n else self.output_token_ids[pos - n]

    @property
    def is_prefill(self) -> bool:
        """True while the tokens left to compute are more than the one fresh decode token."""
        total = self.num_tokens + self.num_output_placeholders
        return self.num_computed_tokens < total - 1 or not (self.output_token_ids or self.num_output_placeholders)
