"""The per-step record the engine core sends the front end's observer (spans, metrics, MFU/MBU).

Built by the core (`core/engine_core.py`), which alone sees what ran (frames really encoded, prefix
lookups, drafts kept); `ScheduledItem.request` is bound to the front end's own `Request` on arrival.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)   # not frozen: a frozen init sets each field through object.__setattr__, 3x the cost, per request per step
class ScheduledItem:
    request_id: str
    num_tokens: int
    context_len: int            # tokens in the KV cache after this step
    is_prefill: bool
    num_frames_encoded: int     # frames the vision tower ran on (encoder-cache hits excluded)
    prefix_queried: int = 0     # on the step first admitting the request: tokens looked up in the prefix cache
    prefix_hit: int = 0         # ... and those whose K/V was found there (this chunk starts after them)
    draft_tokens: int = 0       # a verify chunk (speculative decoding): the drafts it scored
    accepted_drafts: int = 0    # ... and how many of them the target kept (a prefix of them)
    emitted_tokens: int = 0     # tokens this step appended to the request (accepted drafts + the target's own)
    draft_rows: int = 0         # draft steps the assistant ran for it after this step (the batch's longest)
    draft_keys: int = 0         # ... each over this many of the target's cached positions
    # Of num_frames_encoded, how many per modality ("image", "video", "audio"): encoder-cache misses.
    encoded_by_modality: dict[str, int] = field(default_factory=dict)
    # The front end's view of the request (None while the record crosses from the engine process); last,
    # so the engine builds the rest positionally, one per request per step.
    request: Any = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class StepRecord:
    """One engine step: both clocks, so spans (ns epoch) and durations (perf_counter) line up.
    The interval covers the runner (vision, forward, logits) and sampling, not scheduling; the
    vision encoder's own call is [encode_start_perf, encode_end_perf] when the step encoded frames."""

    step_index: int
    start_perf: float
    end_perf: float
    start_ns: int
    end_ns: int
    items: list[ScheduledItem]
    num_running: int
    num_waiting: int
    kv_usage: float
    experts_touched: float | None = None   # distinct experts per MoE layer this step (mean); None: no MoE
    kv_usage_by_pool: dict[str, float] = field(default_factory=dict)
    num_preempted: int = 0
    encode_start_perf: float | None = None   # the step's vision encoder call (perf_counter), None: none ran
    encode_end_perf: float | None = None

    @property
    def duration_s(self) -> float:
        return self.end_perf - self.start_perf
