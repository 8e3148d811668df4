"""What the scheduler decided for one step: the typed hand-off to the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from mmserve.scheduler.request import Request


@dataclass
class ScheduledRequest:
    """`num_tokens` positions starting at `context_len` enter the model this step; the frames listed
    (indices into request.mm_ranges) have all their tokens inside that chunk and are encoded now."""

    request: Request
    num_tokens: int
    context_len: int              # tokens already in the KV cache before this step
    is_prefill: bool
    frames: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the request's last token, so a new token is sampled."""
        return self.context_len + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)   # finished or aborted since the last step

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
