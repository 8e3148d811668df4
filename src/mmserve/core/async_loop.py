"""The async step loop (`--async-scheduling`): step N+1 is launched before step N finishes, so the
device runs N+1 while the host accepts N's tokens, updates the scheduler and emits (docs/
architecture.md, "The engine loop"). `AsyncLoop` is a base of `EngineCore` (core/engine_core.py):
its methods work on the core's state (scheduler, runner, sampler, requests) and share the
synchronous loop's parts (`_schedule`, `_idle`, `_conclude`, `_running`, `_end`, `_sample_rows`).

With a speculative model the acceptance and the drafting run on the device right after the step's
sampling is queued (`_accept_and_draft`), the next step is built as if every draft were kept and
moved back there, and the host accepts the same rows when the tokens land.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from mmserve.attention.buffers import HostCopy, to_device
from mmserve.core.sched.output import DEVICE_DRAFT, SchedulerOutput
from mmserve.ipc.protocol import EngineCoreOutputs
from mmserve.sample.rejection_sampler import accept_on_device, acceptance_layout
from mmserve.sample.sampler import PendingSample, SamplerOutput
from mmserve.spec_decode.speculator import next_step_inputs
from mmserve.spec_decode.verify import speculates, verify_rows
from mmserve.worker.model_runner import SampledTokens, StepResult

logger = logging.getLogger(__name__)


@dataclass
class InFlight:
    """A step launched and not finished (async scheduling): what was scheduled, the runner's result
    (logits on the device), the requests sampled and their sampler rows, the sampling on its way to
    the host (or its result, when it ran row by row), its outcome on the device (the next step's
    inputs) and when it began; with speculation, the drafts made after it on their way to the host
    and, per request that drafted, (draft steps, keys read) for the step record, and per request
    the drafts the step before rejected: scheduled before they were known, this step ran that many
    positions lower than its scheduled chunk says (its record's context is moved back by them)."""

    out: SchedulerOutput
    step: StepResult
    sampling: list
    rows: list
    logits: torch.Tensor
    pending: PendingSample | SamplerOutput
    tokens: SampledTokens
    start_perf: float
    start_ns: int
    drafts: HostCopy | None = None
    drafted: dict[str, tuple[int, int]] = field(default_factory=dict)
    moved_back: dict[str, int] = field(default_factory=dict)


def _rows_of(sampling: list, keep: list[int]) -> list[int]:
    """The sampler rows of the chunks `keep` indexes in `sampling` (a chunk's rows are contiguous,
    `num_sampled_rows` of them): a step's rows without those of requests ended since its launch."""
    first = np.cumsum([0] + [s.num_sampled_rows for s in sampling])
    return [r for i in keep for r in range(first[i], first[i + 1])]


class AsyncLoop:
    """`EngineCore`'s async loop: one `step()` launches the next step and finishes the one before."""

    def _step_async(self, result: EngineCoreOutputs) -> None:
        """One iteration of the async loop: schedule and launch step N+1 (its forward queued, its
        inputs taking step N's tokens on the device), then finish step N (wait for its tokens: one
        pinned copy; accept, update, emit: what the device would otherwise idle through), then
        queue N+1's sampling, which needs N's tokens in the matchers and penalties. The front end
        hears of a step's tokens one iteration after it was launched."""
        out = self._schedule()
        prev, self._in_flight = self._in_flight, None
        self.idle_step = out.is_empty and prev is None
        if self.idle_step:
            self._idle(out)
            return
        launched = None
        if out.is_empty:   # the runner frees what it holds for requests ended since (a step that runs does)
            self.runner.release(out)
            self.runner.confirm_drafts()   # (tensor parallelism) no step follows prev to carry its drafts' check
        else:
            start_perf, start_ns = time.perf_counter(), time.time_ns()
            try:
                launched = (out, self.runner.execute(out, prev.tokens if prev is not None else None),
                            start_perf, start_ns)
            except Exception as exc:   # one bad step must not take the engine down
                self._fail_step(out, exc, result.outputs)
            else:
                self._end_media_failed(launched[1], result.outputs)
        rejected = self._finish(prev, result) if prev is not None else {}
        if launched is not None:
            self._in_flight = self._launch_sampling(*launched)
            self._in_flight.moved_back = rejected

    def _launch_sampling(self, out: SchedulerOutput, step: StepResult, start_perf: float, start_ns: int) -> InFlight:
        """Queue the sampling of a launched step's rows (those of requests still running: the step
        before may have ended some; a verify chunk's drafts the device made are known here now);
        its outcome stays on the device for the next step's inputs. With a speculative model the
        acceptance and the next step's drafts are queued too (`_accept_and_draft`)."""
        keep, row_of = [], {}   # one pass: the requests still running (their rows), device drafts filled in
        for i, s in enumerate(step.sampling):
            rid, drafts = s.request.request_id, s.draft_token_ids
            if self._running(s.request):
                row_of[rid] = len(keep)
                keep.append(i)
                if drafts and drafts[0] == DEVICE_DRAFT:
                    drafts[:] = self._device_drafts[rid][:len(drafts)]
        sampling = step.sampling if len(keep) == len(step.sampling) else [step.sampling[i] for i in keep]
        logits, index = step.logits, None
        if len(keep) < len(step.sampling):   # rows of the requests still running (1 + drafts each)
            index = to_device(np.asarray(_rows_of(step.sampling, keep), dtype=np.int64), logits.device)
            logits = logits.index_select(0, index)
        rows = verify_rows(sampling)
        try:
            pending = self.sampler.launch(logits, rows)
            tokens = pending.tokens
        except Exception:
            logger.exception("step %d: batched sampling failed; sampling row by row", self.step_index)
            pending = self._sample_rows(logits, rows)
            tokens = to_device(np.asarray(pending.token_ids, dtype=np.int64), logits.device)
        flight = InFlight(out, step, sampling, rows, logits, pending,
                          SampledTokens(tokens[:, None], row_of),
                          start_perf, start_ns)
        if self.speculator is not None and sampling:
            self._accept_and_draft(flight, index)
        return flight

    def _accept_and_draft(self, flight: InFlight, kept_rows: torch.Tensor | None) -> None:
        """Async speculation, all queued on the device: the step's acceptance (how many drafts each
        chunk kept, the token after them), then the next step's drafts from that token for every
        request that speculates, started on their way to the host; the next step's inputs take
        both there. The drafter reads the step's hidden states as the runner returned them (every
        rank holds the same, under tensor parallelism), through `kept_rows` where the launch
        dropped ended requests' rows. Under tensor parallelism the round broadcasts the acceptance
        and every rank builds the next inputs from it (`Speculator.draft_on_device`), so the next
        step sends none. A failed drafting round leaves the next step without drafts."""
        sampling, tokens = flight.sampling, flight.tokens.tokens[:, 0]
        accepted = accept_on_device(tokens, acceptance_layout(sampling, flight.rows))
        k = self.speculator.num_tokens
        items, requests = [], []
        for i, s in enumerate(sampling):
            if speculates(s.request.sampling_params):
                items.append(i)
                requests.append(s.request)
        next_inputs = None
        if items:
            try:
                rows = accepted.row if kept_rows is None else kept_rows.index_select(0, accepted.row)
                next_inputs = self.speculator.propose_on_device(
                    requests, items, accepted.next_token, rows, accepted.shift, self.runner.block_tables,
                    self.runner.kv_caches, self.config.block_size, hidden=flight.step.hidden)
            except Exception:   # drafts only save steps: without them every request decodes on
                logger.exception("step %d: drafting failed; the next step verifies no drafts", self.step_index)
        if next_inputs is None:   # no drafts: the next step verifies none (zeros in their places)
            flight.tokens = SampledTokens(next_step_inputs(accepted.next_token, k), flight.tokens.rows, accepted.shift)
            return
        flight.tokens = SampledTokens(next_inputs, flight.tokens.rows, accepted.shift)
        flight.drafts = HostCopy(next_inputs[:, 1:])
        flight.drafted = {}
        for r in requests:   # the next step verifies them; their ids are the device's until the host learns them
            r.draft_token_ids = [DEVICE_DRAFT] * k
            flight.drafted[r.request_id] = (k, r.num_computed_tokens)

    def _finish(self, step: InFlight, result: EngineCoreOutputs) -> dict[str, int]:
        """Step N's end, while N+1 runs: its tokens (and the drafts made after it) reach the host
        (the one wait), then what the synchronous loop does after sampling (`_conclude`), for the
        requests still running. Returns the drafts N rejected per request: N+1 ran that much lower."""
        try:
            sampler_out = step.pending if isinstance(step.pending, SamplerOutput) else step.pending.result()
        except Exception:
            logger.exception("step %d: sampling failed; sampling row by row", self.step_index)
            sampler_out = self._sample_rows(step.logits, step.rows)
        # the drafts the device made after this step, for the step that verifies them (the one launched, or later)
        drafts = step.drafts.result().tolist() if step.drafts is not None else [[]] * len(step.sampling)
        self._device_drafts, waiting, live = {}, [], []   # one pass over the requests sampled
        for i, (s, made) in enumerate(zip(step.sampling, drafts, strict=True)):
            request = s.request
            self._device_drafts[request.request_id] = made
            if request.draft_token_ids and request.draft_token_ids[0] == DEVICE_DRAFT:
                waiting.append(request)   # drafts the step launched did not take: a later one will
            if self._running(request):
                live.append(i)
        for s in step.step.sampling:   # each sampling chunk's placeholders: its tokens are here now
            s.request.num_output_placeholders -= s.num_sampled_rows + s.num_pad_drafts
        if len(live) < len(step.sampling):   # ended (aborted) since the launch: their rows are dropped
            rows = _rows_of(step.sampling, live)
            step.sampling = [step.sampling[i] for i in live]
            sampler_out = SamplerOutput([sampler_out.token_ids[r] for r in rows],
                                        [sampler_out.logprobs[r] for r in rows],
                                        {k: sampler_out.errors[r] for k, r in enumerate(rows) if r in sampler_out.errors})
        accepted = self.rejection.accept(step.sampling, sampler_out, self.eos_token_ids)
        # the keys the drafts read; only the requests that rolled something back (read with .get(rid, 0)):
        # a steady decode step's is empty
        rejected = {a.scheduled.request.request_id: a.rejected for a in accepted if a.rejected}
        drafted = {rid: (steps, keys - rejected.get(rid, 0)) for rid, (steps, keys) in step.drafted.items()}
        # a copy: _conclude adds chunks whose media failed, which the device did not move the next step back by
        self._conclude(step.out, step.step, accepted, step.start_perf, step.start_ns, result,
                       drafted if self.speculator is not None else None, dict(rejected), step.moved_back)
        for request in waiting:   # its tokens are all known now: as many drafts as the synchronous loop makes
            request.draft_token_ids = self._device_drafts[request.request_id][:self.speculator.num_drafts(request)]
        return rejected
