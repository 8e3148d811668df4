"""The front end's half of the step loop: the core's outputs -> per-request deltas, and the observer.

Per engine iteration (one `EngineCoreOutputs`), in the order the core produced it: admitted requests
(`on_request_queued`), the step record (`on_step`, with each item bound to the front end's view of its
request), then every request's new tokens: detokenise, look for stop strings, `on_first_token`, and
end the request exactly once (`on_request_finished`). A request ended here (a stop string, or the
client's abort) ends at once and the caller aborts it in the core; until the core acknowledges that
abort, anything still arriving under its id belongs to the old request and is dropped, so the id can
be reused at once. A request with `observed=False` (the server's warm-up) gets no hook at all, so it
counts in no metric and no span; a step holding only such requests is not reported. Timings count
from `EngineRequest.arrival_time` when the server set it, so they include input processing.
Used by AsyncEngine (outputs from another process or thread)
and by the offline LLM (outputs of an in-process core): the same code, so both behave alike.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from dataclasses import dataclass, field

from mmserve.engine.observer import EngineObserver, NullObserver
from mmserve.engine.output.request_state import RequestState
from mmserve.engine.types import EngineRequest, RequestOutput
from mmserve.errors import EngineInternalError, InvalidInputError, RequestAbortedError
from mmserve.ipc.protocol import CoreOutput, EngineCoreOutputs
from mmserve.request import Request

logger = logging.getLogger(__name__)

Event = tuple[str, "RequestOutput | BaseException"]   # what a request's stream receives


@dataclass
class Processed:
    events: list[Event] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)   # ended here (stop string): abort them in the core


class OutputProcessor:
    def __init__(self, tokenizer=None, observer: EngineObserver | None = None):
        self.tokenizer = tokenizer
        self.observer = observer or NullObserver()
        self.states: dict[str, RequestState] = {}
        self.aborting: collections.Counter[str] = collections.Counter()   # aborts the core has not acknowledged

    def add(self, req: EngineRequest) -> None:
        """Track a request about to be sent to the core; raises what the front end can check itself."""
        if req.request_id in self.states:
            raise InvalidInputError("request_id", f"{req.request_id!r} is already in flight")
        if req.sampling.stop and self.tokenizer is None:
            raise InvalidInputError("stop", "this checkpoint has no tokenizer, so stop strings cannot match")
        if len(req.mm_inputs) != len(req.mm_ranges):
            raise InvalidInputError("mm_inputs", f"{len(req.mm_inputs)} pixel inputs for {len(req.mm_ranges)} ranges")
        request = Request(req.request_id, list(req.prompt_token_ids), req.sampling, mm_ranges=list(req.mm_ranges),
                          mm_inputs=list(req.mm_inputs), priority=req.priority, trace_context=req.trace_context,
                          fork_of=req.fork_of, preprocess_s=req.preprocess_s, open_prompt=req.open_prompt)
        if req.arrival_time is not None:
            request.arrival_time = req.arrival_time  # the server's arrival: timings include decoding
        detok = None
        if self.tokenizer is not None:
            from mmserve.model.tokenizer import IncrementalDetokenizer

            detok = IncrementalDetokenizer(self.tokenizer)
        self.states[req.request_id] = RequestState(request, req.num_frames, detok, preprocess_s=req.preprocess_s,
                                                   videos=list(req.videos), observed=req.observed)

    def engine_started(self, peaks, backend_checks: tuple = ()) -> None:
        """The core is up: hand the observer the device peaks it measured (MFU/MBU denominators) and
        the backends' start-up self-check (when one ran)."""
        self._notify("on_engine_started", peaks)
        if backend_checks:
            self._notify("on_backends_checked", backend_checks)

    def forget(self, request_id: str) -> None:
        """Drop a request the core never received (sending it failed)."""
        self.states.pop(request_id, None)

    def abort(self, request_id: str) -> list[Event]:
        """End a request here (the client went away or asked); the caller aborts it in the core."""
        if request_id not in self.states:
            return []
        events: list[Event] = []
        self._end(request_id, RequestAbortedError(f"request {request_id} was aborted"), events)
        self.aborting[request_id] += 1
        return events

    def process(self, outputs: EngineCoreOutputs) -> Processed:
        done = Processed()
        for rid in outputs.aborted:
            self.aborting[rid] -= 1
            if self.aborting[rid] <= 0:
                del self.aborting[rid]
        for rid in outputs.admitted:
            state = self._live(rid)
            if state is not None:
                state.admitted = True
                if state.observed:
                    self._notify("on_request_queued", state.request)
        if outputs.step is not None:
            self._on_step(outputs.step)
        for out in outputs.outputs:
            self._on_output(out, done)
        return done

    def fail_all(self, error: BaseException) -> list[Event]:
        """End every request still tracked with `error` (the core died or shut down)."""
        events: list[Event] = []
        for rid in list(self.states):
            self._end(rid, error, events)
        return events

    # -- helpers -----------------------------------------------------------------------------------

    def _notify(self, hook: str, *args) -> None:
        """Call an observer hook; a failing observer is logged and never fails a request."""
        try:
            getattr(self.observer, hook)(*args)
        except Exception:
            logger.exception("observer.%s failed", hook)

    def _on_step(self, record) -> None:
        start = time.monotonic() - (time.perf_counter() - record.start_perf)
        items = []
        for item in record.items:
            state = self._live(item.request_id)
            if state is None:          # ended here already (stop string, abort) before the core heard of it
                continue
            if state.first_scheduled is None:
                state.first_scheduled = start
            if state.observed:
                items.append(dataclasses.replace(item, request=state.request))
        if items or not record.items:
            self._notify("on_step", dataclasses.replace(record, items=items))

    def _on_output(self, out: CoreOutput, done: Processed) -> None:
        rid = out.request_id
        state = self._live(rid)
        if state is None:
            return
        if out.error is not None:
            self._end(rid, out.error, done.events)
            return
        try:
            if state.first_token is None and out.new_token_ids:
                state.first_token = time.monotonic()
                if state.observed:
                    self._notify("on_first_token", state.request)
            delta = state.append(out)
        except Exception as exc:
            logger.exception("request %s: output processing failed", rid)
            self._end(rid, EngineInternalError(f"request {rid}: output processing failed: {exc}"), done.events)
            if not out.finished:
                self._stopped(rid, done)
            return
        if delta.finished:
            self._end(rid, delta, done.events)
            if not out.finished:
                self._stopped(rid, done)
        elif delta.new_token_ids or delta.prefilled_tokens:
            done.events.append((rid, delta))

    def _live(self, rid: str) -> RequestState | None:
        """The request `rid` names now; None while an abort of an earlier request with that id is unacknowledged."""
        return None if rid in self.aborting else self.states.get(rid)

    def _stopped(self, rid: str, done: Processed) -> None:
        self.aborting[rid] += 1
        done.stopped.append(rid)

    def _end(self, rid: str, item: RequestOutput | BaseException, events: list[Event]) -> None:
        """The single exit of every request in the front end: tell the observer (if it was admitted), then the stream."""
        state = self.states.pop(rid)
        if state.admitted and state.observed:
            error = item if isinstance(item, BaseException) else None
            reason = None if error is not None else item.finish_reason
            self._notify("on_request_finished", state.request, reason, error)
        events.append((rid, item))
