"""EngineCore: the step loop. schedule -> execute -> sample -> update -> publish, on one thread.

`add_request` and `abort` may be called from any thread: admission is checked on the caller's
thread (so limit errors reach the caller at once) and the request is handed to the engine thread
through a locked inbox. Everything else runs on the engine thread. A failing step fails only the
requests it scheduled; the loop keeps serving.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mmserve.config import EngineConfig
from mmserve.engine.model_runner import ModelRunner
from mmserve.engine.observer import EngineObserver, NullObserver, ScheduledItem, StepRecord
from mmserve.engine.parallel_sampling import check_samples_fit
from mmserve.engine.request_state import RequestState
from mmserve.engine.sampler import Sampler, SamplerOutput
from mmserve.engine.sampling_params import check_vocab
from mmserve.engine.structured_output import StructuredOutput
from mmserve.engine.types import EngineRequest, LoadInfo, RequestOutput
from mmserve.errors import EngineInternalError, InvalidInputError, LimitExceededError, RequestAbortedError
from mmserve.metrics.peaks import detect as detect_peaks
from mmserve.scheduler.kv_cache_manager import KVCacheManager, plan_pools
from mmserve.scheduler.output import SchedulerOutput
from mmserve.scheduler.request import Request
from mmserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

Event = tuple[str, "RequestOutput | BaseException"]   # what the engine publishes per request


def load_engine_model(config: EngineConfig):
    """The model for `config` (device/backend resolved), and its tokenizer when the checkpoint has one."""
    from mmserve.attention import resolve_backend
    from mmserve.model import load_model
    from mmserve.model.loader import resolve_device
    from mmserve.model.tokenizer import load_tokenizer

    device = resolve_device(config.device)
    backend = resolve_backend(config.attention_backend, device)
    model = load_model(config.model, dtype=config.dtype, device=device, attention_backend=backend)
    tokenizer = load_tokenizer(config.model) if (Path(config.model) / "tokenizer.json").is_file() else None
    return model, tokenizer


class EngineCore:
    def __init__(self, config: EngineConfig, *, model=None, tokenizer=None, observer: EngineObserver | None = None):
        if model is None:
            model, tokenizer = load_engine_model(config)
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.observer = observer or NullObserver()
        spec = model.spec
        self.max_model_len = min(config.max_model_len or spec.max_model_len, spec.max_model_len)
        dtype_bytes = torch.empty((), dtype=model.dtype).element_size()
        plans = plan_pools(spec.kv_layer_types, spec.attention_specs, block_size=config.block_size,
                           dtype_bytes=dtype_bytes, num_kv_blocks=config.num_kv_blocks,
                           kv_cache_bytes=config.kv_cache_bytes, max_num_seqs=config.max_num_seqs,
                           max_chunk=config.max_num_batched_tokens)
        self.kv = KVCacheManager(plans, config.block_size, max_model_len=self.max_model_len,
                                 enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
                                   max_waiting_requests=config.max_waiting_requests,
                                   policy=config.scheduling_policy)
        self.runner = ModelRunner(model, plans, config, max_model_len=self.max_model_len)
        self.eos_token_ids = frozenset(spec.eos_token_ids)
        grammar = (StructuredOutput(tokenizer, spec.vocab_size, sorted(self.eos_token_ids))
                   if tokenizer is not None else None)
        self.sampler = Sampler(config.seed, sorted(self.eos_token_ids), grammar)
        self.states: dict[str, RequestState] = {}      # engine thread only
        self.step_index = 0
        self._idle_step = False                          # the last step scheduled nothing
        self._cond = threading.Condition()
        self._inbox: list[RequestState] = []
        self._aborts: list[str] = []
        self._live: set[str] = set()                    # admitted and not yet ended (guarded by _cond)
        self._forks: dict[str, list[Request]] = {}      # parent id -> samples waiting for its prompt's KV
        logger.info("engine: %s, KV pools %s, max_model_len %d",
                    model.attention_backend,
                    {t: p.num_blocks for t, p in plans.items()}, self.max_model_len)
        # MFU/MBU denominators, measured (when not in the table) where this engine's torch work runs.
        self.peaks = detect_peaks(str(model.device), config.dtype)
        self._notify("on_engine_started", self.peaks)

    # -- any thread -----------------------------------------------------------------------------------------

    def add_request(self, req: EngineRequest) -> None:
        """Admit a request or raise (InvalidInputError / LimitExceededError) without queueing it."""
        if req.sampling.stop and self.tokenizer is None:
            raise InvalidInputError("stop", "this checkpoint has no tokenizer, so stop strings cannot match")
        if len(req.mm_inputs) != len(req.mm_ranges):
            raise InvalidInputError("mm_inputs", f"{len(req.mm_inputs)} pixel inputs for {len(req.mm_ranges)} ranges")
        check_vocab(req.sampling, self.model.spec.vocab_size)
        matcher = None
        if req.sampling.response_format is not None:
            if self.sampler.grammar is None:
                raise InvalidInputError("sampling.response_format", "this checkpoint has no tokenizer to build masks from")
            matcher = self.sampler.grammar.matcher(req.sampling.response_format)   # compiles on a cache miss
        request = Request(req.request_id, list(req.prompt_token_ids), req.sampling, mm_ranges=list(req.mm_ranges),
                          mm_inputs=list(req.mm_inputs), priority=req.priority, trace_context=req.trace_context,
                          fork_of=req.fork_of)
        self.scheduler.check_admissible(request)
        if req.sampling.n > 1 and req.fork_of is None:
            check_samples_fit(self.kv, request.num_prompt_tokens, req.sampling.max_tokens, req.sampling.n,
                              self.config.max_num_batched_tokens)
        detok = None
        if self.tokenizer is not None:
            from mmserve.model.tokenizer import IncrementalDetokenizer

            detok = IncrementalDetokenizer(self.tokenizer)
        state = RequestState(request, req.num_frames, detok)
        with self._cond:
            if req.request_id in self._live:
                raise InvalidInputError("request_id", f"{req.request_id!r} is already in flight")
            if len(self._inbox) + len(self.scheduler.waiting) >= self.config.max_waiting_requests:
                raise LimitExceededError(f"{self.config.max_waiting_requests} requests are already waiting",
                                         "--max-waiting-requests", retryable=True)
            self._live.add(req.request_id)
            if matcher is not None:
                self.sampler.grammar.add(req.request_id, matcher)
            self._inbox.append(state)
            self._cond.notify()

    def abort(self, request_id: str) -> bool:
        """Ask the engine thread to stop a request within one step. False if it is not in flight."""
        with self._cond:
            if request_id not in self._live:
                return False
            self._aborts.append(request_id)
            self._cond.notify()
            return True

    def load(self) -> LoadInfo:
        with self._cond:
            inbox = len(self._inbox)
        forks = sum(len(f) for f in list(self._forks.values()))
        return LoadInfo(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting) + inbox + forks,
                        kv_usage=self.kv.usage(), max_num_seqs=self.config.max_num_seqs,
                        kv_cached_usage=self.kv.cached_usage())

    def wait_for_work(self, stop: threading.Event, timeout: float = 0.5) -> None:
        """Sleep until a request or abort arrives; never spin while requests wait for nothing."""
        with self._cond:
            if self._inbox or self._aborts or stop.is_set():
                return
            if not self.states:
                self._cond.wait(timeout)
            elif self._idle_step:   # in flight but nothing could be scheduled: don't busy-loop
                self._cond.wait(0.001)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # -- engine thread ---------------------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.states or self._inbox or self._aborts)

    def _notify(self, hook: str, *args) -> None:
        """Call an observer hook; a failing observer is logged and never fails a request."""
        try:
            getattr(self.observer, hook)(*args)
        except Exception:
            logger.exception("observer.%s failed", hook)

    def _end(self, rid: str, events: list[Event], item: RequestOutput | BaseException,
             reason: str | None = None) -> None:
        """The single exit of every admitted request: free everything, tell the observer and the stream."""
        state = self.states.pop(rid)
        if state.request.fork_of in self._forks and state.request in self._forks[state.request.fork_of]:
            self._forks[state.request.fork_of].remove(state.request)
        self.scheduler.finish(rid)
        self.sampler.free(rid)
        self._release_forks()
        with self._cond:
            self._live.discard(rid)
        self._notify("on_request_finished", state.request, reason,
                     item if isinstance(item, BaseException) else None)
        events.append((rid, item))

    def _take_inbox(self, events: list[Event]) -> None:
        with self._cond:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for state in inbox:
            request = state.request
            self.states[request.request_id] = state
            parent = self.states.get(request.fork_of) if request.fork_of else None
            if parent is not None and parent.request.num_computed_tokens < parent.request.num_prompt_tokens:
                self._forks.setdefault(request.fork_of, []).append(request)   # until its prompt is computed
            else:
                self.scheduler.enqueue(request)
            self._notify("on_request_queued", request)
        for rid in aborts:
            if rid in self.states:
                self._end(rid, events, RequestAbortedError(f"request {rid} was aborted"))

    def step(self) -> list[Event]:
        """Run one step; returns what to publish (deltas, final outputs, errors) per request."""
        events: list[Event] = []
        self._take_inbox(events)
        out = self.scheduler.schedule()
        self._idle_step = out.is_empty
        if out.is_empty:
            return events
        start_perf, start_ns = time.perf_counter(), time.time_ns()
        now = time.monotonic()
        for s in out.scheduled:
            state = self.states[s.request.request_id]
            if state.first_scheduled is None:
                state.first_scheduled = now
        try:
            result = self.runner.execute(out)
            sampled = self.sampler.sample(result.logits, [s.request for s in result.sampled])
            for s in out.scheduled:
                if s.request.request_id in result.prompt_logprobs:   # stored by position: a recompute overwrites
                    state = self.states[s.request.request_id]
                    state.prompt_logprobs[s.num_computed_tokens:] = result.prompt_logprobs[s.request.request_id]
        except Exception as exc:   # one bad step must not take the engine down
            self._fail_step(out, exc, events)
            return events
        self.scheduler.update(out)
        self._release_forks()
        end_perf, end_ns = time.perf_counter(), time.time_ns()
        # Record before publishing: the observer must see a request's last step before its end, so
        # request.perf (carried by the Final message) includes that step.
        self._record(out, result.frames_encoded, start_perf, end_perf, start_ns, end_ns)
        self._publish_tokens(result.sampled, sampled, events)
        return events

    def _release_forks(self) -> None:
        """Queue the samples whose parent has computed its prompt (or has ended)."""
        for parent_id in [p for p, forks in self._forks.items() if forks or p not in self.states]:
            parent = self.states.get(parent_id)
            if parent is None or parent.request.num_computed_tokens >= parent.request.num_prompt_tokens:
                for request in self._forks.pop(parent_id):
                    self.scheduler.enqueue(request)

    def _publish_tokens(self, sampled, out: SamplerOutput, events: list[Event]) -> None:
        now = time.monotonic()
        for s, token, logprobs in zip(sampled, out.token_ids, out.logprobs, strict=True):
            rid = s.request.request_id
            state = self.states[rid]
            try:
                s.request.output_token_ids.append(token)
                if state.first_token is None:
                    state.first_token = now
                    self._notify("on_first_token", s.request)
                delta = state.append(token, self.eos_token_ids, logprobs)
            except Exception as exc:
                logger.exception("request %s: output processing failed", rid)
                self._end(rid, events, EngineInternalError(f"request {rid}: output processing failed: {exc}"))
                continue
            if delta.finished:
                if delta.finish_reason == "length" and not self.sampler.grammar_complete(rid):
                    delta.finish_detail = "max_tokens reached before the output completed its response_format"
                self._end(rid, events, delta, delta.finish_reason)
            elif delta.new_token_ids:
                events.append((rid, delta))

    def _fail_step(self, out: SchedulerOutput, exc: Exception, events: list[Event]) -> None:
        ids = [s.request.request_id for s in out.scheduled]
        logger.error("engine step %d failed for requests %s", self.step_index, ids, exc_info=exc)
        self.step_index += 1
        for rid in ids:
            if rid in self.states:
                self._end(rid, events, EngineInternalError(f"request {rid}: engine step failed: {exc!r}"))

    def _record(self, out: SchedulerOutput, frames_encoded: dict[str, int], start_perf: float, end_perf: float,
                start_ns: int, end_ns: int) -> None:
        items = [ScheduledItem(s.request.request_id, s.num_tokens, s.seq_len, s.is_prefill,
                               frames_encoded.get(s.request.request_id, 0), s.request,
                               prefix_queried=0 if s.num_cached_tokens is None else s.request.num_tokens,
                               prefix_hit=s.num_cached_tokens or 0)
                 for s in out.scheduled]
        by_pool = self.kv.usage_by_pool()
        record = StepRecord(self.step_index, start_perf, end_perf, start_ns, end_ns, items,
                            len(self.scheduler.running), len(self.scheduler.waiting), max(by_pool.values(), default=0.0),
                            experts_touched=self.model.experts_touched(), kv_usage_by_pool=by_pool)
        self.step_index += 1
        self._notify("on_step", record)

    def shutdown_requests(self, error: BaseException) -> list[Event]:
        """End every request still in flight (engine thread, after the loop stopped)."""
        events: list[Event] = []
        self._take_inbox(events)
        for rid in list(self.states):
            self._end(rid, events, error)
        return events

    def _fail_everything(self, exc: Exception) -> list[Event]:
        """After a bug outside the model step (scheduling, bookkeeping) the engine's state is suspect:
        end everything in flight visibly rather than retry the same failure forever."""
        events: list[Event] = []
        try:
            self._take_inbox(events)
            for rid in list(self.states):
                self._end(rid, events, EngineInternalError(f"request {rid}: engine error: {exc!r}"))
        except Exception:
            logger.exception("could not fail the requests in flight cleanly")
        return events

    def run(self, sink: Callable[[list[Event]], None], stop: threading.Event) -> None:
        """The engine thread's loop: step while there is work, sleep on the inbox otherwise."""
        while not stop.is_set():
            self.wait_for_work(stop)
            if stop.is_set():
                break
            try:
                events = self.step()
            except Exception as exc:
                logger.exception("engine loop error; failing every request in flight")
                events = self._fail_everything(exc)
            if events:
                sink(events)
