"""EngineCore: the step loop. schedule -> execute -> sample -> update, and nothing else.

The core owns the model, the KV caches, the scheduler and the sampler, and is driven from one thread
(the engine process's main thread, or the offline LLM's caller). It speaks plain data: an
`EngineCoreRequest` in, one `EngineCoreOutputs` per step out (new token ids, "eos"/"length" ends,
per-request errors, a `StepRecord`). Detokenisation, stop strings, timings and the observer live in
the front end (`engine/output/processor.py`), off this loop's critical path.

A failing step fails only the requests it scheduled; the loop keeps serving. A request whose own
sampling fails (its grammar cannot go on), or whose media an encoder fails on (the runner's
`StepResult.media_failed`), ends alone, and no error names another request. A
request with a response_format not compiled yet waits off the scheduler while the compile worker
runs (`structured_output/compiler.py`): the step loop never compiles.

With a speculative model (`spec_decode/`) a step may verify drafts: its sampled rows are accepted
(`sample/rejection_sampler.py`: longest matching prefix + the target's next token, cut at EOS and
max_tokens), the tokens are
appended before the scheduler's update rolls the rejected positions back (so the prefix cache keys
verified tokens only; a grammar advances over them only), and the assistant drafts the next step's
tokens before the step ends. The async loop (`--async-scheduling`: step N+1 launched before step N
finishes, speculation's acceptance and drafting on the device) is `core/async_loop.py`'s `AsyncLoop`,
this class's base.

Live sessions (engine/live_session.py) hold open prompts: contexts that grow with `extend_request`,
never sample, and report their computed tokens after each step that advanced them. They hold their
blocks until aborted (the session's prefix cannot be evicted while it lives); a session's contexts
share one reservation, room for two full histories (the context answering and the one a roll-over
rebuilds), and all sessions' reservations together stay within `--live-kv-share` of each pool.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path

import torch

from mmserve.config import EngineConfig
from mmserve.core.async_loop import AsyncLoop, InFlight
from mmserve.core.kv_cache.manager import KVCacheManager
from mmserve.core.live import LiveReservations, check_extension, context_media
from mmserve.core.sched.output import SchedulerOutput
from mmserve.core.sched.scheduler import Scheduler
from mmserve.core.sched.step_time import StepTimeModel
from mmserve.errors import EngineInternalError, InvalidInputError, LimitExceededError, MMServeError
from mmserve.ipc.protocol import (
    CoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ExtendRequest,
    KvCapacity,
    LoadInfo,
    TokenLogprobs,
)
from mmserve.ipc.records import ScheduledItem, StepRecord
from mmserve.metrics.peaks import detect as detect_peaks
from mmserve.metrics.perf_model import PerfModel
from mmserve.request import Request
from mmserve.sample.rejection_sampler import Accepted, RejectionSampler
from mmserve.sample.sampler import Sampler, SamplerOutput
from mmserve.sampling_params import check_vocab
from mmserve.spec_decode.speculator import DraftFrom, Speculator
from mmserve.spec_decode.verify import speculates, verify_rows
from mmserve.structured_output.compiler import FormatCompiler
from mmserve.structured_output.manager import StructuredOutput
from mmserve.worker.backend_check import merge_checks
from mmserve.worker.memory_profile import device_baseline, size_kv_cache
from mmserve.worker.model_runner import ModelRunner, StepResult

logger = logging.getLogger(__name__)

COMPILE_WAIT_S = 0.001   # an idle step's wait for a pending grammar compile (the offline loop would spin)


def uses_async_scheduling(config: EngineConfig, device: torch.device) -> bool:
    """`--async-scheduling`: auto is on CUDA (where the device runs a step while the host prepares
    the next), with or without tensor parallelism."""
    return config.async_scheduling == "on" or (config.async_scheduling == "auto" and device.type == "cuda")


def _media_error(request_id: str, why: str) -> EngineInternalError:
    return EngineInternalError(f"request {request_id}: {why}; details in the server log")


def _media_failed(a: Accepted, failed: dict[str, str]) -> Accepted:
    """`a` as an error when its request's media failed to encode this step (its tokens came from zero
    embeddings); its step-mates keep theirs."""
    rid = a.scheduled.request.request_id
    if rid not in failed or a.error is not None:
        return a
    return Accepted(a.scheduled, [], None, None, a.scheduled.num_tokens, _media_error(rid, failed[rid]))


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


class EngineCore(AsyncLoop):
    """`tokenizer` (the checkpoint's) builds structured-output masks; without one, requests with a
    response_format are refused. `runner_factory` builds the runner (ModelRunner's signature; the
    tensor-parallel rank 0 passes its own, executor/tensor_parallel.py)."""

    def __init__(self, config: EngineConfig, *, model=None, tokenizer=None, runner_factory=None):
        from mmserve.model.loader import resolve_device

        memory, baseline = device_baseline(config, model.device if model is not None else resolve_device(config.device))
        if model is None:
            model, tokenizer = load_engine_model(config)
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        spec = model.spec
        self.max_model_len = min(config.max_model_len or spec.max_model_len, spec.max_model_len)
        self.async_scheduling = uses_async_scheduling(config, model.device)
        self.speculator = (Speculator.load(config.speculative_model, model, config.num_speculative_tokens,
                                           max_num_seqs=config.max_num_seqs)
                           if config.speculative_model else None)
        kv_specs = self.speculator.kv_specs(spec.attention_specs) if self.speculator else spec.attention_specs
        # from the device's memory (a profiling step: worker/memory_profile.py) unless a size is given
        plan, sized_by, profiled_checks = size_kv_cache(model, config, kv_specs, max_model_len=self.max_model_len,
                                                        speculator=self.speculator, memory=memory, baseline=baseline)
        if plan.max_num_seqs < config.max_num_seqs:   # the KV cache holds windows for fewer (logged)
            self.config = config = dataclasses.replace(config, max_num_seqs=plan.max_num_seqs)
        plans = plan.pools
        self.kv_capacity = KvCapacity(plan.pool_tokens(config.block_size),
                                      plan.full_context_requests(config.block_size, self.max_model_len),
                                      plan.num_bytes, plan.max_num_seqs, sized_by)
        self.kv = KVCacheManager(plans, config.block_size, max_model_len=self.max_model_len,
                                 enable_prefix_caching=config.enable_prefix_caching)
        self.runner = (runner_factory or ModelRunner)(model, plans, config, max_model_len=self.max_model_len)
        if self.speculator is not None:   # the drafter's K steps as graphs where the target's steps are
            self.speculator.use_graphs(self.runner.graphs.mode, max_num_seqs=config.max_num_seqs)   # the plan's
        if profiled_checks:   # the profiling runner checked first: a fallback there is what serves
            self.runner.backend_checks = merge_checks(profiled_checks, self.runner.backend_checks)
        # MFU/MBU denominators, measured (when not in the table) where this engine's torch work runs;
        # the front end hands them to its observer (on_engine_started). The scheduler's step-time model
        # divides by them too.
        self.peaks = detect_peaks(str(model.device), config.dtype)
        step_time = (StepTimeModel(PerfModel(spec, dtype=config.dtype, tp=config.tensor_parallel_size),
                                   flops=self.peaks.flops, bandwidth=self.peaks.bandwidth,
                                   slowdown=config.max_step_slowdown)
                     if config.max_step_slowdown else None)
        self.scheduler = Scheduler(self.kv, max_num_batched_tokens=config.max_num_batched_tokens,
                                   prefill_batched_tokens=config.prefill_batched_tokens,
                                   max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
                                   policy=config.scheduling_policy, verify_width=self.runner.verify_graph_rows,
                                   async_scheduling=self.async_scheduling,
                                   encode_ahead=config.encode_ahead, step_time=step_time)
        self.eos_token_ids = frozenset(spec.eos_token_ids)
        # No time limit here: the front end refused what does not compile within it (it compiles first).
        grammar = (StructuredOutput(FormatCompiler(tokenizer, spec.vocab_size, sorted(self.eos_token_ids),
                                                   cache_bytes=config.grammar_cache_bytes, timeout_s=math.inf))
                   if tokenizer is not None else None)
        self.sampler = Sampler(config.seed, sorted(self.eos_token_ids), grammar, max_num_seqs=config.max_num_seqs)
        self.rejection = RejectionSampler(self.sampler, self.speculator.record if self.speculator else None)
        self.requests: dict[str, Request] = {}   # admitted and not yet ended
        self.prompt_logprobs: dict[str, list[TokenLogprobs]] = {}   # entry j: prompt token j + 1, when asked
        self.step_index = 0
        self.idle_step = False                   # the last step scheduled nothing
        self._admitted: list[str] = []           # since the last step() returned
        self._aborted: list[str] = []            # abort acknowledgements since then
        self._compiling: dict[str, Future] = {}      # request id -> its response_format's compile
        self._in_flight: InFlight | None = None      # async scheduling: the step launched, not yet finished
        self._device_drafts: dict[str, list[int]] = {}   # async speculation: drafts the device made, learned since
        self._live = LiveReservations(self.kv, config, self.max_model_len)
        logger.info("engine: %s, KV pools %s, max_model_len %d", model.attention_backend,
                    {t: p.num_blocks for t, p in plans.items()}, self.max_model_len)

    @property
    def has_work(self) -> bool:
        return bool(self.requests or self._aborted or self._admitted or self._in_flight)

    def add_request(self, req: EngineCoreRequest) -> None:
        """Admit a request or raise (InvalidInputError / LimitExceededError) without queueing it."""
        mm_inputs = (context_media(self.requests.get(req.context_request_id), req) if req.context_request_id
                     else list(req.mm_inputs))
        if len(mm_inputs) != len(req.mm_ranges):
            raise InvalidInputError("mm_inputs", f"{len(mm_inputs)} pixel inputs for {len(req.mm_ranges)} ranges")
        if req.request_id in self.requests:
            raise InvalidInputError("request_id", f"{req.request_id!r} is already in flight")
        check_vocab(req.sampling, self.model.spec.vocab_size)
        fmt = req.sampling.response_format
        compiled = None
        if fmt is not None:
            if self.sampler.grammar is None:
                raise InvalidInputError("sampling.response_format", "this checkpoint has no tokenizer to build masks from")
            compiled = self.sampler.grammar.compiler.cached(fmt)   # raises a cached refusal
        request = Request(req.request_id, list(req.prompt_token_ids), req.sampling, mm_ranges=list(req.mm_ranges),
                          mm_inputs=mm_inputs, priority=req.priority, owner=req.owner,
                          fork_of=req.fork_of, open_prompt=req.open_prompt)
        self.scheduler.check_admissible(request)
        if len(self.scheduler.waiting) + len(self._compiling) >= self.config.max_waiting_requests:
            raise LimitExceededError(f"{self.config.max_waiting_requests} requests are already waiting",
                                     "--max-waiting-requests", retryable=True)
        if req.open_prompt:   # last of the checks: only `_end` gives a reservation back
            self._live.reserve(req)
        self.requests[req.request_id] = request
        self._admitted.append(req.request_id)
        if fmt is not None and compiled is None:
            self._compiling[req.request_id] = self.sampler.grammar.compiler.submit(fmt)   # queued once compiled
            return
        if compiled is not None:
            self.sampler.grammar.add(req.request_id, fmt, compiled)
        self.scheduler.enqueue(request)

    def extend_request(self, msg: ExtendRequest, outputs: list[CoreOutput]) -> None:
        """Append to an open prompt; a bad extension ends that request with its error (in `outputs`).
        An id no longer here (aborted since) is ignored."""
        request = self.requests.get(msg.request_id)
        if request is None:
            return
        try:
            check_extension(request, msg, self.scheduler.max_num_batched_tokens)
        except MMServeError as exc:
            self._end(msg.request_id, CoreOutput(msg.request_id, error=exc), outputs)
            return
        request.extend_prompt(list(msg.token_ids), [tuple(r) for r in msg.mm_ranges], list(msg.mm_inputs))

    def _queue_compiled(self, outputs: list[CoreOutput]) -> None:
        """Queue the requests whose grammar has compiled since the last step; end those refused."""
        for rid in [rid for rid, future in self._compiling.items() if future.done()]:
            future = self._compiling.pop(rid)
            request = self.requests[rid]
            try:
                self.sampler.grammar.add(rid, request.sampling_params.response_format, future.result())
            except MMServeError as exc:
                self._end(rid, CoreOutput(rid, error=exc), outputs)
                continue
            except Exception as exc:
                logger.error("request %s: its response_format failed to compile", rid, exc_info=exc)
                self._end(rid, CoreOutput(rid, error=EngineInternalError(
                    f"request {rid}: its response_format failed to compile ({type(exc).__name__})")), outputs)
                continue
            self.scheduler.enqueue(request)

    def abort(self, request_id: str) -> bool:
        """Free a request the front end has ended; acknowledged with the next step. False if unknown."""
        self._aborted.append(request_id)
        if request_id not in self.requests:
            return False
        self._end(request_id, None, [])
        return True

    def load(self) -> LoadInfo:
        held = len(self.scheduler.forks) + len(self._compiling)
        return LoadInfo(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting) + held,
                        kv_usage=self.kv.usage(), max_num_seqs=self.config.max_num_seqs,
                        kv_cached_usage=self.kv.cached_usage())

    def held_resources(self) -> dict:
        """What the core still holds for requests (requests, referenced KV blocks, embeddings encoded
        ahead for them, live sessions' KV reservations), and the encoder cache's bytes over its
        budget: empty values and 0 when idle. Cached free blocks and encoder-cache entries outlive
        their requests on purpose (prefix caching), so they do not count."""
        cache = self.runner.encoder_cache
        return {"requests": sorted(self.requests), "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
                "kv_blocks_held": {name: sum(c > 0 for c in pool.ref_cnt) for name, pool in self.kv.pools.items()
                                   if pool.num_free != pool.num_usable or any(pool.ref_cnt)},
                "encoded_ahead_bytes": self.runner.encoded_ahead_bytes(),   # every rank's
                "live_sessions_reserving": self._live.sessions(),
                "encoder_cache_over_bytes": max(0, cache.num_bytes - cache.max_bytes)}

    def set_kv_events(self, on: bool) -> bool:
        """Build the prefix cache's key-change events (a router subscribed) or stop; switching on
        starts them with a snapshot of the cache (ipc/kv_cache_events.py)."""
        self.kv.set_events(on)
        return on

    def flush_prefix_cache(self) -> bool:
        """Drop every cached prefix (the next request computes everything); False while requests are
        in flight, whose blocks cannot be dropped under them."""
        return not self.requests and self.kv.flush()

    def _end(self, rid: str, output: CoreOutput | None, outputs: list[CoreOutput]) -> None:
        """The single exit of every admitted request: free everything, report it once (unless the
        front end ended it: `output` None)."""
        self.requests.pop(rid)
        self._compiling.pop(rid, None)
        self._live.release(rid)
        self.prompt_logprobs.pop(rid, None)
        self.scheduler.finish(rid)   # samples held for its prompt queue then
        self.sampler.free(rid)
        if output is not None:
            outputs.append(output)

    def _collect(self) -> EngineCoreOutputs:
        """Start this iteration's outputs with what happened since the last one (admissions, aborts)."""
        admitted, self._admitted = self._admitted, []
        aborted, self._aborted = self._aborted, []
        return EngineCoreOutputs(load=None, aborted=aborted, admitted=admitted)

    def step(self) -> EngineCoreOutputs:
        """Run one step (if anything is schedulable); returns everything to report, with the load after it."""
        result = self._collect()
        try:
            self._queue_compiled(result.outputs)
            if self.async_scheduling:
                self._step_async(result)
            else:
                self._step(result)
        except Exception as exc:   # a bug outside the model step: the core's state is suspect
            logger.exception("engine loop error; failing every request in flight")
            self._in_flight = None
            self.fail_all(EngineInternalError(f"engine error ({type(exc).__name__}; details in the server log)"),
                          result.outputs)
        result.load = self.load()
        result.kv_events = self.kv.take_events()
        return result

    def _idle(self, out: SchedulerOutput) -> None:
        """A step that runs nothing, in either loop: what the runner (every rank's, under tensor
        parallelism) holds for the requests that ended or were preempted since, their embeddings
        encoded ahead among it, is freed here (a step that runs frees it in the runner); while a
        grammar compiles, wait for it briefly instead of spinning."""
        self.runner.release(out)
        if self._compiling:
            wait(list(self._compiling.values()), timeout=COMPILE_WAIT_S, return_when=FIRST_COMPLETED)

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's next step; the requests it preempted give their penalty slots back."""
        out = self.scheduler.schedule()
        for rid in out.preempted_ids:
            self.sampler.preempted(rid)
        return out

    def _step(self, result: EngineCoreOutputs) -> None:
        out = self._schedule()
        self.idle_step = out.is_empty
        if out.is_empty:
            self._idle(out)
            return
        start_perf, start_ns = time.perf_counter(), time.time_ns()
        try:
            step = self.runner.execute(out)
            rows = verify_rows(step.sampling)
            sampler_out = self._sample(step.logits, rows)
            accepted = self.rejection.accept(step.sampling, sampler_out, self.eos_token_ids)
        except Exception as exc:   # one bad step must not take the engine down
            self._fail_step(out, exc, result.outputs)
            return
        self._conclude(out, step, accepted, start_perf, start_ns, result)

    def _running(self, request: Request) -> bool:
        """Whether `request`, as a step scheduled it, is still the request running under its id: an
        id may be reused as soon as its request ends (async scheduling: while a step that scheduled
        the old one is still in flight), and that step's rows are not the new request's."""
        return self.requests.get(request.request_id) is request

    def _conclude(self, out: SchedulerOutput, step: StepResult, accepted: list[Accepted], start_perf: float,
                  start_ns: int, result: EngineCoreOutputs,
                  drafted: dict[str, tuple[int, int]] | None = None, rejected: dict[str, int] | None = None,
                  moved_back: dict[str, int] | None = None) -> None:
        """A step's end once its tokens are accepted, in either loop: prompt logprobs stored, the
        scheduler's update (rejected drafts and pads, chunks whose media failed; `rejected` per
        request where the caller counted them already), drafting (unless the async loop drafted on
        the device already: `drafted`), the step record (`moved_back`: the async loop's step ran
        that many positions below its scheduled chunk), the outputs."""
        prompt_logprobs = step.prompt_logprobs.result()
        # by id, for the few requests read below (none in a steady decode step: no dict then)
        scheduled = {s.request.request_id: s for s in out.scheduled} if prompt_logprobs or step.media_failed else {}
        for rid, logprobs in prompt_logprobs.items():   # stored by position: a recompute overwrites
            if self._running(scheduled[rid].request):
                self.prompt_logprobs.setdefault(rid, [])[scheduled[rid].num_computed_tokens:] = logprobs
        rejected = ({a.scheduled.request.request_id: a.rejected for a in accepted if a.rejected}   # (read with .get(rid, 0))
                    if rejected is None else rejected)
        if step.media_failed:
            for s in out.scheduled:   # media that failed to encode: the chunk is dropped (no K/V keyed), the request ends
                if s.request.request_id in step.media_failed:
                    rejected[s.request.request_id] = s.num_tokens
            accepted = [_media_failed(a, step.media_failed) for a in accepted]
        self.scheduler.update(out, rejected)   # parallel samples whose prompt is now computed join here
        if drafted is None and self.speculator is not None:
            drafted = {}
            try:
                drafted = self._draft(step, accepted)
            except Exception:   # drafts only save steps: without them every request decodes on
                logger.exception("step %d: drafting failed; the next step verifies no drafts", self.step_index)
        end_perf, end_ns = time.perf_counter(), time.time_ns()
        result.step = self._record(out, step, start_perf, end_perf, start_ns, end_ns, accepted, drafted or {},
                                   moved_back or {})
        self._emit(accepted, result.outputs)
        for rid, why in step.media_failed.items():   # those mid-prompt (no row sampled): ended here
            if self._running(scheduled[rid].request):
                self._end(rid, CoreOutput(rid, error=_media_error(rid, why)), result.outputs)
        result.outputs.extend(CoreOutput(s.request.request_id, prefilled_tokens=s.seq_len)
                              for s in out.scheduled if s.request.open_prompt and self._running(s.request))

    def _end_media_failed(self, step: StepResult, outputs: list[CoreOutput]) -> None:
        """Async loop: the requests whose media failed to encode in the step just launched end now,
        as a failed launch's do, not when the step finishes. The scheduler counts a chunk computed
        once it is launched: the step in flight's update, and the window's release before the next
        step, key its blocks, and a parallel sample joins its parent's prompt, so a chunk run on
        zero embeddings must not stay in flight under a running request."""
        for rid, why in step.media_failed.items():
            self._end(rid, CoreOutput(rid, error=_media_error(rid, why)), outputs)

    def _sample(self, logits: torch.Tensor, requests: list) -> SamplerOutput:
        """The step's tokens, batched; if the batch raises, row by row, so a request whose own sampling
        fails ends alone (with an error in its row) and its step-mates still get their tokens. Unseeded
        rows may then draw otherwise than in a clean run (the failed batch moved their generator on);
        a seeded row's uniform is a hash of (seed, output position): it draws the same token."""
        try:
            return self.sampler.sample(logits, requests)
        except Exception:
            logger.exception("step %d: batched sampling failed; sampling row by row", self.step_index)
        return self._sample_rows(logits, requests)

    def _sample_rows(self, logits: torch.Tensor, requests: list) -> SamplerOutput:
        """Row by row: a request whose own sampling fails ends alone (an error in its row)."""
        out = SamplerOutput([], [])
        for i, request in enumerate(requests):
            try:
                row = self.sampler.sample(logits[i:i + 1], [request])
            except Exception as exc:
                logger.error("request %s: sampling failed", request.request_id, exc_info=exc)
                row = SamplerOutput([0], [None], {0: EngineInternalError(
                    f"request {request.request_id}: sampling failed ({type(exc).__name__}; details in the server log)")})
            out.token_ids += row.token_ids
            out.logprobs += row.logprobs
            if 0 in row.errors:
                out.errors[i] = row.errors[0]
        return out

    def _draft(self, step: StepResult, accepted: list[Accepted]) -> dict[str, tuple[int, int]]:
        """The next step's drafts for every request that goes on and speculates; returns, per request
        that drafted, (draft steps the batched loop ran, keys each read) for the perf model."""
        items, row = [], 0
        for a in accepted:
            first, row = row, row + len(a.scheduled.draft_token_ids) + 1
            request = a.scheduled.request
            if a.finish_reason or a.error or not speculates(request.sampling_params):
                continue
            if (k := self.speculator.num_drafts(request)) > 0:
                items.append(DraftFrom(request, a.tokens[-1], first + len(a.tokens) - 1, request.num_computed_tokens, k))
        for item, drafts in zip(items, self.speculator.propose(items, self.runner.block_tables, self.runner.kv_caches,
                                                                self.config.block_size, hidden=step.hidden,
                                                                grammar=self.sampler.grammar),
                                strict=True):
            item.request.draft_token_ids = drafts
        rows = max((i.num_drafts for i in items), default=0)   # the loop runs every item to the longest
        return {i.request.request_id: (rows, i.num_keys) for i in items}

    def _emit(self, accepted: list[Accepted], outputs: list[CoreOutput]) -> None:
        for a in accepted:
            request = a.scheduled.request
            rid = request.request_id
            if a.error is not None:
                self._end(rid, CoreOutput(rid, error=a.error), outputs)
                continue
            params = request.sampling_params
            # positional (its first five fields), one per request per step: cheaper than by keyword
            out = CoreOutput(rid, a.tokens, a.finish_reason, a.logprobs, request.num_cached_tokens)
            if out.finish_reason == "length" and not self.sampler.grammar_complete(rid):
                out.finish_detail = "max_tokens reached before the output completed its response_format"
            if out.finish_reason is None:
                outputs.append(out)
                continue
            if params.prompt_logprobs:
                out.prompt_logprobs = self.prompt_logprobs.get(rid, [])
            self._end(rid, out, outputs)

    def _fail_step(self, out: SchedulerOutput, exc: Exception, outputs: list[CoreOutput]) -> None:
        ids = [s.request.request_id for s in out.scheduled]
        logger.error("engine step %d failed for requests %s", self.step_index, ids, exc_info=exc)
        self.step_index += 1
        for s in out.scheduled:   # the exception's text may name a step-mate: it stays in the log
            rid = s.request.request_id
            if self._running(s.request):
                self._end(rid, CoreOutput(rid, error=EngineInternalError(
                    f"request {rid}: engine step failed ({type(exc).__name__}; details in the server log)")), outputs)

    def _record(self, out: SchedulerOutput, step: StepResult, start_perf: float, end_perf: float,
                start_ns: int, end_ns: int, accepted: list[Accepted],
                drafted: dict[str, tuple[int, int]], moved_back: dict[str, int]) -> StepRecord:
        """The step as the front end's observer sees it. What only the core knows (frames really encoded,
        prefix-cache lookups, drafts kept) is read here; `ScheduledItem.request` is bound in the front end."""
        by_request = {a.scheduled.request.request_id: a for a in accepted}
        frames, by_modality, none = step.frames_encoded, step.encoded_by_modality, (0, 0)
        items = []
        for s in out.scheduled:   # (the lookups skip the dicts that are empty in a steady decode step)
            request = s.request
            rid = request.request_id
            a = by_request.get(rid)
            new = len(a.tokens) if a is not None else 0   # appended since scheduling
            draft_rows, draft_keys = drafted.get(rid, none) if drafted else none
            back = moved_back.get(rid, 0) if moved_back else 0
            items.append(ScheduledItem(   # positional (its field order), one per request per step: cheaper
                rid, s.num_tokens, s.num_computed_tokens + s.num_tokens - back, s.is_prefill,
                frames.get(rid, 0) if frames else 0,
                0 if s.num_cached_tokens is None else request.num_tokens - new,   # prefix_queried
                s.num_cached_tokens or 0, len(s.draft_token_ids),   # prefix_hit, draft_tokens
                a.num_accepted if a is not None else 0, new, draft_rows, draft_keys,   # accepted, emitted, draft rows/keys
                by_modality[rid] if rid in by_modality else {}))
        encode_start, encode_end = step.encode_perf or (None, None)
        by_pool = self.kv.usage_by_pool()
        record = StepRecord(self.step_index, start_perf, end_perf, start_ns, end_ns, items,
                            len(self.scheduler.running), len(self.scheduler.waiting), max(by_pool.values(), default=0.0),
                            experts_touched=step.experts_touched(), kv_usage_by_pool=by_pool,
                            num_preempted=len(out.preempted_ids), encode_start_perf=encode_start,
                            encode_end_perf=encode_end)
        self.step_index += 1
        return record

    def shutdown(self, error: BaseException) -> EngineCoreOutputs:
        """End every request in flight with `error`; the last outputs to report."""
        self._in_flight = None
        result = self._collect()
        self.fail_all(error, result.outputs)
        result.load = self.load()
        if self.sampler.grammar is not None:
            self.sampler.grammar.compiler.shutdown()
        return result

    def fail_all(self, error: BaseException, outputs: list[CoreOutput]) -> None:
        """End every request in flight with `error` (engine shutdown, or a bug that makes state suspect)."""
        for rid in list(self.requests):
            ended = CoreOutput(rid, error=type(error)(f"request {rid}: {error}"))
            try:
                self._end(rid, ended, outputs)
            except Exception:   # its state is suspect: still report it, or its stream stays open
                logger.exception("could not end request %s cleanly", rid)
                self.requests.pop(rid, None)
                outputs.append(ended)
