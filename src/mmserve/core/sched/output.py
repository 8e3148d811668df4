"""What the scheduler decided for one step: the plain-data hand-off to the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from mmserve.request import Request

# A draft the device makes after the step before (async scheduling with speculation): the runner
# takes its id there; the host learns it with that step's tokens, before this step samples.
DEVICE_DRAFT = -1


@dataclass
class BlockUpdate:
    """How one request's block table in one pool changed since it was last scheduled: entries from
    `start` on are `new_block_ids`, and the first `num_reclaimed` entries now point at the null block."""

    start: int
    new_block_ids: list[int]
    num_reclaimed: int


@dataclass(slots=True)   # one per scheduled request per step: slots make it ~35% cheaper to build
class ScheduledRequest:
    """`num_tokens` positions starting at `num_computed_tokens` enter the model this step; the frames
    listed (indices into request.mm_ranges) have tokens inside that chunk, and their embeddings go to
    those tokens: all of an image's or frame's tokens, or an audio segment's share of the chunk."""

    request: Request
    num_tokens: int
    num_computed_tokens: int      # tokens already in the KV cache before this step
    is_prefill: bool              # Request.is_prefill when scheduled (the one definition; ScheduledItem carries it on)
    frames: list[int] = field(default_factory=list)
    block_updates: dict[str, BlockUpdate] = field(default_factory=dict)   # per pool; only pools that changed
    # A verify chunk (speculative decoding): the drafts that follow the request's last token; each of
    # the 1 + len rows is sampled.
    draft_token_ids: list[int] = field(default_factory=list)
    # Positions after the drafts that fill a verify chunk to 1 + K rows, so every speculating request
    # of a step has the same rows and the step replays one graph: never sampled, always rolled back.
    num_pad_drafts: int = 0
    # Set on the step that first admits the request with prefix caching on: the tokens whose K/V came
    # from the cache (num_computed_tokens; 0 on a miss). None for a request that was already running,
    # and for a preempted request's return (the prefix-cache counters count new requests' lookups only).
    num_cached_tokens: int | None = None

    @property
    def num_sampled_rows(self) -> int:
        """Rows the step samples for this request when its chunk samples: its last token and each draft."""
        return 1 + len(self.draft_token_ids)

    @property
    def is_verify(self) -> bool:
        """A verify chunk: the last token, drafts and pad positions (`num_tokens` of them)."""
        return bool(self.draft_token_ids) or self.num_pad_drafts > 0

    @property
    def seq_len(self) -> int:
        """Tokens in the KV cache after this step."""
        return self.num_computed_tokens + self.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)   # finished or aborted since the last step
    # per pool, (source, destination) KV blocks to copy before this step's forward: a parallel sample's
    # copy of its parent's partial last prompt block (KVCacheManager.share_prefix)
    block_copies: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    # The frames (indices into request.mm_ranges) the next step will likely consume, per request whose
    # prompt goes on after this step's chunk (Scheduler._lookahead): the runner encodes them while
    # this step runs. A guess: a wrong one costs an early encode, never a wrong token.
    encode_ahead: list[tuple[Request, list[int]]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
