"""The plain data a tensor-parallel step travels as (executor/tensor_parallel.py broadcasts it).

Rank 0's `StepEncoder` turns each SchedulerOutput into a `StepMessage`: a request's prompt, sampling
parameters and pixels the first step it is scheduled, then only the output tokens the workers lack
or that changed; ScheduledRequest/SchedulerOutput fields by name, so a field added to either
travels with no change here, but for `encode_ahead`, whose requests travel by id. A worker's
`StepMirror` keeps those requests and rebuilds each step's SchedulerOutput from the message, reading
to its ModelRunner exactly as rank 0's does: every rank then encodes the same media ahead, in the
same order and batches (the towers are replicated), so the ranks' embeddings stay identical.
A step that schedules nothing runs on no rank: the requests that ended or were preempted meanwhile
reach the workers as a `Released` message instead.

Async scheduling: a step is sent before the step in flight's tokens are known on the host, so the
message names only their layout (`InFlightTokens`); the tokens themselves go from rank 0's device
to every rank's in one broadcast right after it (`share_in_flight`), queued behind rank 0's sampling.
With speculation the drafting round after a step broadcasts that step's acceptance instead, and
every rank builds the outcome itself from it and its own drafts (`HeldOutcome`): one broadcast a
step either way. Those drafts are the argmax of logits every rank holds whole (all-gathered), so
they are rank 0's; each worker checks that against rank 0's drafts one step later (`verified`) and
stops the group if not (rank 0's step then fails before it emits the tokens they scored).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from mmserve.attention.buffers import HostCopy
from mmserve.core.sched.output import ScheduledRequest, SchedulerOutput
from mmserve.request import Request


@dataclass
class NewRequest:
    """What a worker's runner reads of a request, sent the first step it is scheduled."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: object
    mm_ranges: list[tuple[int, int]]
    mm_inputs: list

    @classmethod
    def of(cls, r: Request) -> NewRequest:
        return cls(r.request_id, r.prompt_token_ids, r.sampling_params, r.mm_ranges, r.mm_inputs)

    def to_request(self) -> Request:
        return Request(self.request_id, self.prompt_token_ids, self.sampling_params, self.mm_ranges, self.mm_inputs)


@dataclass
class StepMessage:
    """One step for the workers. `scheduled`: each ScheduledRequest's fields but `request` (by id);
    `outputs`: per scheduled request, its output tokens from index `start` on: every token the
    workers lack or that changed (tokens past the request's computed ones, which a rollback may
    replace), so each mirror holds rank 0's list; `ahead`: `encode_ahead` as (request id, range
    indices), the pixels being the mirror's already; `rest`: SchedulerOutput's other fields."""

    new: list[NewRequest] = field(default_factory=list)
    outputs: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    scheduled: list[tuple[str, dict]] = field(default_factory=list)
    ahead: list[tuple[str, list[int]]] = field(default_factory=list)
    rest: dict = field(default_factory=dict)
    in_flight: InFlightTokens | None = None
    # request id -> the drafts rank 0 verified in the step before, where that step took a held
    # outcome (`HeldOutcome.check`: every worker's own drafts must be these)
    verified: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class InFlightTokens:
    """The layout of the step in flight's outcome (worker/model_runner.SampledTokens) the step takes
    its last inputs from: each sampled request's row, the width of a row (1 + drafts), whether
    the positions the acceptance rolled back come with it (speculation), and whether the workers
    built it themselves in the drafting round after that step (`held`: nothing is broadcast)."""

    rows: dict[str, int]
    width: int
    shifted: bool
    held: bool = False

    @classmethod
    def of(cls, prev, held: bool = False) -> InFlightTokens:
        return cls(prev.rows, prev.tokens.shape[1], prev.shift is not None, held)


def share_in_flight(group, layout: InFlightTokens, prev=None, device=None):
    """The step in flight's `SampledTokens` on every rank: rank 0 passes its own (`prev`), the others
    receive them, through one broadcast of [rows, width (+ 1: the shift)] ids (none when it sampled
    no row: the layout says so). On NCCL it is queued on the stream behind rank 0's sampling (no
    host sync); on gloo it is synchronous."""
    from mmserve.worker.model_runner import SampledTokens

    if prev is not None:
        packed = prev.tokens if prev.shift is None else torch.cat([prev.tokens, prev.shift[:, None]], dim=1)
        packed = packed.to(torch.int64).contiguous()
    else:
        packed = torch.empty((len(layout.rows), layout.width + layout.shifted), dtype=torch.int64, device=device)
    if layout.rows:
        group.broadcast(packed)
    if prev is not None:
        return prev
    if not layout.shifted:
        return SampledTokens(packed, layout.rows)
    return SampledTokens(packed[:, :layout.width].contiguous(), layout.rows, packed[:, layout.width].contiguous())


class DraftsDiverged(RuntimeError):
    """A worker drafted other tokens than rank 0: the ranks' inputs are no longer the same."""


class HeldOutcome:
    """A worker's own copy of the step in flight's outcome under async speculation: the drafting
    round after a step gives every rank rank 0's acceptance (one broadcast) and its own drafts,
    from which it builds the next step's inputs as rank 0 does (`Speculator.draft_on_device`); the
    next step's message then says `held` and names the rows. The drafts start their copy to the
    host, and one step later each is checked against what rank 0 verified (`check`)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._held: tuple[torch.Tensor, torch.Tensor, HostCopy] | None = None
        self._taken: tuple[dict[str, int], HostCopy] | None = None   # what the last step took

    def hold(self, tokens: torch.Tensor, shift: torch.Tensor) -> None:
        self._held = (tokens, shift, HostCopy(tokens[:, 1:]))

    def take(self, layout: InFlightTokens | None):
        """The outcome the step described by `layout` starts from: the one held (`layout.held`), or
        None (the caller receives it by `share_in_flight`); a held one is dropped either way."""
        from mmserve.worker.model_runner import SampledTokens

        held, self._held, self._taken = self._held, None, None
        if layout is None or not layout.held:
            return None
        if held is None or held[0].shape != (len(layout.rows), layout.width) or not layout.shifted:
            raise RuntimeError(f"tensor-parallel rank {self.rank}: the step takes an outcome of {len(layout.rows)} "
                               f"rows x {layout.width} from its drafting round, which "
                               + ("did not run" if held is None else f"made {tuple(held[0].shape)}"))
        self._taken = (layout.rows, held[2])
        return SampledTokens(held[0], layout.rows, held[1])

    def check(self, verified: dict[str, list[int]]) -> None:
        """Rank 0's drafts that the last step verified against this rank's own, which that step ran
        on: any difference means the ranks' drafter logits differ (they must be bit-identical: the
        same kind of device and kernels on every rank): raise, so the group stops, and rank 0's
        step fails before it emits the tokens scored over them (it emits them after this step)."""
        if self._taken is None or not verified:
            return
        rows, copy = self._taken
        own = copy.result().tolist()
        for rid, drafts in verified.items():
            row = rows.get(rid)
            if row is not None and (mine := own[row][:len(drafts)]) != drafts:
                raise DraftsDiverged(f"tensor-parallel rank {self.rank} drafted {mine[:8]} for request {rid} where "
                                     f"rank 0 drafted {drafts[:8]}: the ranks' drafter logits differ (speculation "
                                     "under async tensor parallelism needs them bit-identical: the same kind of "
                                     "device and kernels on every rank)")


@dataclass
class Released:
    """Requests that ended (`finished_ids`) or were preempted in steps that scheduled nothing (no
    StepMessage went out): each worker drops their mirrors and frees what its runner holds for them."""

    finished_ids: list[str]
    preempted_ids: list[str]


@dataclass
class DraftsCheck:
    """No step follows the one in flight (every request's tokens are in flight), so no step message
    carries the drafts it verified: they come in one message of their own, each worker checks them
    against its own (`HeldOutcome.check`), and every rank then meets in one all-reduce, which fails
    on rank 0 if a worker stopped, before that step's tokens are emitted."""

    verified: dict[str, list[int]]


@dataclass
class HeldQuery:
    """Rank 0 asks for the bytes each rank holds encoded ahead (the core's leak check): every rank
    answers in one all-reduce of its count."""


def held_bytes(runner) -> torch.Tensor:
    """A rank's answer to `HeldQuery`: its runner's bytes encoded ahead, for the all-reduce."""
    return torch.tensor([runner.encoded_ahead_bytes()], dtype=torch.int64, device=runner.model.device)


def _fields(obj, *skip: str) -> dict:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.name not in skip}


class StepEncoder:
    """Rank 0's side: what the workers already know, so each request's prompt travels once."""

    def __init__(self) -> None:
        self.sent_outputs: dict[str, int] = {}   # request id -> output tokens the workers have

    def encode(self, out: SchedulerOutput) -> StepMessage:
        msg = StepMessage(rest=_fields(out, "scheduled", "encode_ahead"))
        self.release(out.finished_ids)   # first: a finished id may come back as a new request this step
        for s in out.scheduled:
            r, rid = s.request, s.request.request_id
            self._introduce(r, msg)
            computed = max(0, s.num_computed_tokens - r.num_prompt_tokens)   # output tokens already in the KV cache
            start = min(self.sent_outputs[rid], computed, len(r.output_token_ids))
            msg.outputs[rid] = (start, r.output_token_ids[start:])
            self.sent_outputs[rid] = len(r.output_token_ids)
            msg.scheduled.append((rid, _fields(s, "request")))
        for r, frames in out.encode_ahead:   # running requests: all sent before (unless one never ran)
            self._introduce(r, msg)
            msg.ahead.append((r.request_id, frames))
        return msg

    def release(self, finished_ids: list[str]) -> None:
        """Those requests ended: a request with one of their ids is a new one."""
        for rid in finished_ids:
            self.sent_outputs.pop(rid, None)

    def _introduce(self, r: Request, msg: StepMessage) -> None:
        if r.request_id not in self.sent_outputs:
            msg.new.append(NewRequest.of(r))
            self.sent_outputs[r.request_id] = 0


class StepMirror:
    """A worker's side: the requests rank 0 scheduled, rebuilt into SchedulerOutputs."""

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}

    def decode(self, msg: StepMessage) -> SchedulerOutput:
        self.release(msg.rest.get("finished_ids", ()))   # the runner frees them by id; the requests go now
        for new in msg.new:
            self.requests[new.request_id] = new.to_request()
        for rid, (start, tokens) in msg.outputs.items():
            out = self.requests[rid].output_token_ids
            del out[start:]
            out.extend(tokens)
        scheduled = [ScheduledRequest(request=self.requests[rid], **rest) for rid, rest in msg.scheduled]
        ahead = [(self.requests[rid], frames) for rid, frames in msg.ahead]
        return SchedulerOutput(scheduled=scheduled, encode_ahead=ahead, **msg.rest)

    def release(self, finished_ids) -> None:
        for rid in finished_ids:
            self.requests.pop(rid, None)
