"""TelemetryObserver: the engine's observer that turns steps into spans, metrics and `request.perf`.

The front end's output processor calls it once per step, from the step record the engine core sends
with its outputs (every scheduled request's num_tokens, context_len, is_prefill). It prices the step
with the perf model (per GPU), divides the text part among the requests by token share, prices the
step's one encoder call as it ran (frames padded to the longest, weights read once) and bills each
request its own frames, bills the speculative drafter's steps after it to the requests that drafted
(by their draft rows), and emits:

- per request, children of the request's `mmserve.generate` span (`request.trace_context`):
  `mmserve.vision.encode` for a step that encoded its frames, `mmserve.prefill` per prefill chunk,
  and one `mmserve.decode` covering the decode phase. Each carries mmserve.perf.{flops, read_bytes,
  write_bytes, mfu, mbu, attn_flops.sliding, attn_flops.full}; mfu/mbu there are the utilisation of
  the steps the span covers (the request's share of work over the whole steps' time would
  understate a batch).
- `mmserve.engine.step`, for one step in `1 / step_trace_ratio`, with the step's totals (its
  interconnect bytes per GPU, `mmserve.perf.comm_bytes`, among them) and links to the spans of the
  requests in the batch.
- metrics (TTFT, TPOT, e2e, queue time, running/waiting/KV usage per pool, MFU/MBU, token counters,
  FLOPs/bytes/step time by step phase); the latency histograms are recorded in the request's trace
  context, so their exemplars name its trace.
- `request.perf`: the request's totals, set as it ends, so its final gRPC message can carry them
  (only that message reads them: recomputing them every step cost the front end's loop per request).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from opentelemetry import trace
from opentelemetry.trace import Link, Span, Status, StatusCode, Tracer

from mmserve.errors import RequestAbortedError
from mmserve.metrics.peaks import DevicePeaks, utilization
from mmserve.metrics.perf_model import (
    AudioWork,
    DraftWork,
    PerfBreakdown,
    PerfModel,
    RequestWork,
    StepContext,
    VisionWork,
)
from mmserve.metrics.prometheus import MODALITIES, EngineMetrics, StepMetrics
from mmserve.metrics.tracing import get_tracer
from mmserve.request import AudioFeatures

logger = logging.getLogger(__name__)

PREFILL_SPAN = "mmserve.prefill"
DECODE_SPAN = "mmserve.decode"
VISION_SPAN = "mmserve.vision.encode"
AUDIO_SPAN = "mmserve.audio.encode"
STEP_SPAN = "mmserve.engine.step"
UNKNOWN_PEAKS = DevicePeaks("unknown", 0.0, 0.0, "none")  # utilization() reports 0 against a 0 peak


@dataclass(frozen=True, slots=True)
class _Totals:
    """A PerfBreakdown's sums, taken once per step: the step bills the same parts to each of its
    requests (by share), and summing the breakdown's per-component dicts per request cost the front
    end's loop ~10 us a request a step."""

    flops: float = 0.0
    read_bytes: float = 0.0
    write_bytes: float = 0.0
    attn_flops_sliding: float = 0.0
    attn_flops_full: float = 0.0

    @property
    def bytes(self) -> float:
        return self.read_bytes + self.write_bytes

    @classmethod
    def of(cls, part: PerfBreakdown) -> _Totals:
        return cls(part.total_flops, part.total_read_bytes, part.total_write_bytes, part.attn_flops_sliding,
                   part.attn_flops_full)


NO_WORK = _Totals()


@dataclass
class _Work:
    """Work billed to a span or a request, plus the busy time of the steps it ran in."""

    flops: float = 0.0
    read_bytes: float = 0.0
    write_bytes: float = 0.0
    attn_flops_sliding: float = 0.0
    attn_flops_full: float = 0.0
    step_flops: float = 0.0     # totals of the steps involved, for utilisation
    step_bytes: float = 0.0
    step_seconds: float = 0.0

    def add(self, part: _Totals, share: float, step: _Totals, seconds: float) -> None:
        self.flops += share * part.flops
        self.read_bytes += share * part.read_bytes
        self.write_bytes += share * part.write_bytes
        self.attn_flops_sliding += share * part.attn_flops_sliding
        self.attn_flops_full += share * part.attn_flops_full
        self.step_flops += step.flops
        self.step_bytes += step.bytes
        self.step_seconds += seconds

    def summary(self, peaks: DevicePeaks) -> dict[str, float]:
        return {
            "flops": self.flops, "read_bytes": self.read_bytes, "write_bytes": self.write_bytes,
            "mfu": utilization(self.step_flops, self.step_seconds, peaks.flops, "MFU"),
            "mbu": utilization(self.step_bytes, self.step_seconds, peaks.bandwidth, "MBU"),
            "attn_flops_sliding": self.attn_flops_sliding, "attn_flops_full": self.attn_flops_full,
        }


def perf_attributes(summary: dict[str, float]) -> dict[str, float]:
    """request.perf keys -> span attribute names (attn_flops_sliding -> mmserve.perf.attn_flops.sliding)."""
    return {f"mmserve.perf.{k.replace('attn_flops_', 'attn_flops.')}": v for k, v in summary.items()}


@dataclass
class _VisionShare:
    executed: PerfBreakdown   # this request's frames as run, with its share of the weights' read
    useful_flops: float       # the same frames without padding patches
    num_frames: int


@dataclass
class _VisionStep:
    executed: PerfBreakdown   # the whole encoder call of the step
    padded_patches: int       # patches per frame as run
    by_request: dict[str, _VisionShare]


@dataclass
class _RequestState:
    queued_monotonic: float
    prefill_chunks: int = 0
    first_scheduled: bool = False
    first_token_monotonic: float | None = None
    decode_span: Span | None = None
    decode_work: _Work = field(default_factory=_Work)
    draft_tokens: int = 0       # speculative decoding: drafts verified over the decode phase
    accepted_drafts: int = 0
    verify_chunks: int = 0
    total: _Work = field(default_factory=_Work)


class TelemetryObserver:
    """Implements mmserve.engine.observer.EngineObserver. Called from the one thread that reads engine outputs."""

    def __init__(self, perf_model: PerfModel, peaks: DevicePeaks | None = None, *, tracer: Tracer | None = None,
                 metrics: EngineMetrics | None = None, step_trace_ratio: float = 0.01,
                 patches_per_frame: int = 0):
        self.perf = perf_model
        self.peaks = peaks or UNKNOWN_PEAKS  # the engine's own arrive with on_engine_started
        self.tracer = tracer or get_tracer()
        self.metrics = metrics
        self.step_every = round(1 / step_trace_ratio) if step_trace_ratio > 0 else 0
        vision = perf_model.spec.vision
        self.patches_per_frame = patches_per_frame or (vision.default_patches if vision else 0)
        self._requests: dict[str, _RequestState] = {}

    # -- observer protocol -------------------------------------------------------------------------

    def on_engine_started(self, peaks: DevicePeaks) -> None:
        """The denominators the engine measured or looked up where it runs; exported as metrics too."""
        self.peaks = peaks
        if self.metrics is not None:
            self.metrics.set_peaks(peaks)
            self.metrics.set_parallel_layout(self.perf.tp)

    def on_backends_checked(self, checks: tuple) -> None:
        """The start-up self-check's results (worker/backend_check.py), exported as an info metric."""
        if self.metrics is not None:
            self.metrics.set_backend_checks(checks)

    def on_request_queued(self, request: Any) -> None:
        self._requests[request.request_id] = _RequestState(queued_monotonic=getattr(request, "arrival_time", time.monotonic()))
        # Once per request with media (a sample of n > 1 shares its parent's preprocessing).
        if self.metrics is not None and getattr(request, "mm_ranges", None) and getattr(request, "fork_of", None) is None:
            self.metrics.preprocess_time.record(getattr(request, "preprocess_s", 0.0), context=_context(request))

    def on_step(self, record: Any) -> None:
        seconds = record.duration_s
        requests = tuple(map(request_work, record.items))
        text = self.perf.step(StepContext(requests, experts_touched=getattr(record, "experts_touched", None)),
                              per_gpu=True)
        vision = self._vision(record)
        audio = {item.request_id: self._audio(item) for item in record.items if item.num_frames_encoded}
        audio = {rid: self.perf.step(StepContext(audio=works), per_gpu=True) for rid, works in audio.items() if works}
        drafts = draft_work(record)
        drafter = self.perf.step(StepContext(drafts=drafts), per_gpu=True) if drafts else None
        step = PerfBreakdown()
        step.add(text)
        if vision is not None:
            step.add(vision.executed)
        for part in audio.values():
            step.add(part)
        if drafter is not None:
            step.add(drafter)
        draft_rows = sum(d.num_rows for d in drafts) or 1
        mfu = utilization(step.total_flops, seconds, self.peaks.flops, "MFU")
        mbu = utilization(step.total_bytes, seconds, self.peaks.bandwidth, "MBU")
        num_tokens = sum(r.num_tokens for r in requests) or 1
        started = time.monotonic() - (time.perf_counter() - record.start_perf)
        text_t, step_t = _Totals.of(text), _Totals.of(step)
        drafter_t = _Totals.of(drafter) if drafter is not None else NO_WORK
        for item in record.items:
            state = self._requests.setdefault(item.request_id, _RequestState(queued_monotonic=started))
            if not state.first_scheduled:
                state.first_scheduled = True
                self._on_first_schedule(item.request, started - state.queued_monotonic)
            share = item.num_tokens / num_tokens
            state.total.add(text_t, share, step_t, seconds)
            if drafter is not None and getattr(item, "draft_rows", 0):   # its own draft rows' share
                draft_share = item.draft_rows / draft_rows
                state.total.add(drafter_t, draft_share, NO_WORK, 0.0)
                if not item.is_prefill:
                    state.decode_work.add(drafter_t, draft_share, NO_WORK, 0.0)
            frames = vision.by_request.get(item.request_id) if vision is not None else None
            if frames is not None:
                frames_t = _Totals.of(frames.executed)
                state.total.add(frames_t, 1.0, NO_WORK, 0.0)
                # The span covers the encoder call itself when the engine timed it (else the step), and its
                # MFU/MBU are that call's: all of its frames' work over its time.
                start_ns, end_ns, call_s = _encode_interval(record)
                self._span(VISION_SPAN, item, record, frames_t, 1.0,
                           _Totals.of(vision.executed) if call_s else step_t,
                           call_s or seconds, {
                               "mmserve.vision.num_frames": frames.num_frames,
                               "mmserve.vision.padded_patches": vision.padded_patches,
                               "mmserve.vision.useful_flops": frames.useful_flops,
                           }, interval=(start_ns, end_ns) if call_s else None)
            heard = audio.get(item.request_id)
            if heard is not None:   # its segments as one encoder call's share (segments batch like frames)
                heard_t = _Totals.of(heard)
                state.total.add(heard_t, 1.0, NO_WORK, 0.0)
                start_ns, end_ns, call_s = _encode_interval(record)
                self._span(AUDIO_SPAN, item, record, heard_t, 1.0, step_t, call_s or seconds,
                           {"mmserve.audio.num_segments": len(self._audio(item))},
                           interval=(start_ns, end_ns) if call_s else None)
            if item.is_prefill:
                attributes = {
                    "mmserve.prefill.chunk_index": state.prefill_chunks,
                    "mmserve.prefill.num_tokens": item.num_tokens,
                    "mmserve.prefill.context_len": item.context_len,
                }
                if item.prefix_queried:   # the admitting chunk: it starts after the tokens the cache served
                    attributes["mmserve.prefill.cached_tokens"] = item.prefix_hit
                self._span(PREFILL_SPAN, item, record, text_t, share, step_t, seconds, attributes)
                state.prefill_chunks += 1
            else:
                self._decode_step(state, item, record, text_t, share, step_t, seconds)
        if self.step_every and record.step_index % self.step_every == 0:
            self._step_span(record, step, mfu, mbu)
        if self.metrics is not None:
            prefill = any(i.is_prefill for i in record.items)
            decode = any(not i.is_prefill for i in record.items)
            self.metrics.record_step(StepMetrics(
                record.num_running, record.num_waiting, dict(getattr(record, "kv_usage_by_pool", None) or {}),
                mfu, mbu, "mixed" if prefill and decode else "prefill" if prefill else "decode",
                step.total_flops, step.total_bytes, seconds, step.total_comm_bytes))
            self.metrics.record_prefix_cache(sum(i.prefix_queried for i in record.items),
                                             sum(i.prefix_hit for i in record.items))
            self.metrics.frames_encoded.add(sum(i.num_frames_encoded for i in record.items))
            for modality, (queries, hits) in self._encoder_cache(record).items():
                self.metrics.record_encoder_cache(modality, queries, hits)
            self.metrics.record_speculation(record.items)
            if not self._requests:   # the core counted requests the front end has ended (an abort in flight)
                self.metrics.record_idle()

    def on_first_token(self, request: Any) -> None:
        state = self._requests.get(request.request_id)
        now = time.monotonic()
        if state is not None:
            state.first_token_monotonic = now
        if self.metrics is not None:
            self.metrics.ttft.record(now - getattr(request, "arrival_time", now), context=_context(request))

    def on_request_finished(self, request: Any, finish_reason: str | None, error: BaseException | None) -> None:
        state = self._requests.pop(request.request_id, None)
        if state is not None:
            request.perf.update(state.total.summary(self.peaks))
            span = state.decode_span
            if span is not None:
                span.set_attributes(perf_attributes(state.decode_work.summary(self.peaks)))
                span.set_attribute("mmserve.decode.num_tokens", len(getattr(request, "output_token_ids", ())))
                if state.verify_chunks:
                    span.set_attributes({"mmserve.speculative.draft_tokens": state.draft_tokens,
                                         "mmserve.speculative.accepted_tokens": state.accepted_drafts,
                                         "mmserve.speculative.verify_chunks": state.verify_chunks})
                _end(span, error)
        if self.metrics is None:
            return
        now = time.monotonic()
        self.metrics.e2e.record(now - getattr(request, "arrival_time", now), context=_context(request))
        outputs = len(getattr(request, "output_token_ids", ()))
        self.metrics.generation_tokens.add(outputs)
        if state is not None and state.first_token_monotonic is not None and outputs > 1:
            self.metrics.tpot.record((now - state.first_token_monotonic) / (outputs - 1), context=_context(request))
        self.metrics.finished.add(1, {"finish_reason": _finish_label(finish_reason, error)})
        if not self._requests:   # the engine runs no further step to report its (idle) state
            self.metrics.record_idle()

    # -- helpers -----------------------------------------------------------------------------------

    def _encoder_cache(self, record: Any) -> dict[str, tuple[int, int]]:
        """modality -> (encoder-cache queries, hits) of the step: every image, frame and audio segment
        with a token in a request's chunk was looked up (its K/V is computed now; an audio segment split
        between chunks, in each); those the core did not encode were found."""
        spec = self.perf.spec
        queries: dict[str, int] = dict.fromkeys(MODALITIES, 0)
        encoded: dict[str, int] = dict.fromkeys(MODALITIES, 0)
        for item in record.items:
            first = item.context_len - item.num_tokens
            ids = getattr(item.request, "prompt_token_ids", ())
            for start, end in getattr(item.request, "mm_ranges", ()):
                if end >= first and start < item.context_len:
                    token = ids[start] if start < len(ids) else None
                    queries["video" if token == spec.video_token_id else
                            "audio" if token is not None and token == spec.audio_token_id else "image"] += 1
            for modality, n in getattr(item, "encoded_by_modality", {}).items():
                encoded[modality] = encoded.get(modality, 0) + n
        return {m: (queries[m], max(0, queries[m] - encoded.get(m, 0))) for m in queries}

    def _frames(self, item: Any) -> list[tuple[int, VisionWork]]:
        """(rows as batched, useful work) of the frames whose ranges start inside this chunk: the rows
        include the preprocessor's padding patches, the useful work counts only real patches."""
        request = item.request
        first = item.context_len - item.num_tokens
        inputs = list(getattr(request, "mm_inputs", ()))
        found = []
        for i, (start, end) in enumerate(getattr(request, "mm_ranges", ())):
            if i < len(inputs) and isinstance(inputs[i], AudioFeatures):
                continue   # the audio tower's: _audio
            if first <= start < item.context_len:
                if i < len(inputs):
                    rows = int(inputs[i].pixel_values.shape[0])
                    real = int((inputs[i].position_ids[:, 0] >= 0).sum())
                else:
                    rows = real = self.patches_per_frame
                found.append((rows, VisionWork(real, end - start + 1)))
        encoded = item.num_frames_encoded - len(self._audio(item))   # the rest went through the audio tower
        found = found[:encoded]
        missing = encoded - len(found)
        return found + [(self.patches_per_frame, VisionWork(self.patches_per_frame))] * missing

    @staticmethod
    def _audio(item: Any) -> tuple[AudioWork, ...]:
        """The audio segments this chunk encoded: those starting in it (a segment split between chunks
        is encoded with its first), at most as many as the step encoded for the request."""
        request, first = item.request, item.context_len - item.num_tokens
        inputs = list(getattr(request, "mm_inputs", ()))
        return tuple(AudioWork(int(inputs[i].features.shape[0]), end - start + 1)
                     for i, (start, end) in enumerate(getattr(request, "mm_ranges", ()))
                     if i < len(inputs) and isinstance(inputs[i], AudioFeatures) and first <= start < item.context_len
                     )[:item.num_frames_encoded]

    def _vision(self, record: Any) -> _VisionStep | None:
        """The step's encoder call priced as executed (every frame padded to the longest, then to the
        pooling window: the runner batches them so), the encoder's weights read once for the call and
        shared among requests by frame count, and each request's useful (unpadded) FLOPs beside it."""
        frames = {item.request_id: fs for item in record.items if item.num_frames_encoded and (fs := self._frames(item))}
        vision = self.perf.spec.vision
        if not frames or vision is None:
            return None
        window = vision.pool_kernel ** 2
        padded = -(-max(rows for fs in frames.values() for rows, _ in fs) // window) * window

        def executed(count: int) -> PerfBreakdown:
            return self.perf.step(StepContext(images=(VisionWork(padded, padded // window),) * count), per_gpu=True)

        total = sum(len(fs) for fs in frames.values())
        whole = executed(total)
        by_request = {}
        for request_id, fs in frames.items():
            part = executed(len(fs))
            part.read_bytes["vision.weight"] = whole.read_bytes["vision.weight"] * len(fs) / total
            useful = self.perf.step(StepContext(images=tuple(w for _, w in fs)), per_gpu=True).total_flops
            by_request[request_id] = _VisionShare(part, useful, len(fs))
        return _VisionStep(whole, padded, by_request)

    def _on_first_schedule(self, request: Any, queue_s: float) -> None:
        if self.metrics is None:
            return
        self.metrics.queue_time.record(max(0.0, queue_s), context=_context(request))
        self.metrics.prompt_tokens.add(getattr(request, "num_prompt_tokens", 0))
        self.metrics.mm_tokens.add(getattr(request, "num_mm_tokens", 0))

    def _span(self, name: str, item: Any, record: Any, part: _Totals, share: float, step: _Totals,
              seconds: float, attributes: dict[str, Any], interval: tuple[int, int] | None = None) -> None:
        """A finished child span of the request over the step (or `interval`, epoch ns)."""
        parent = getattr(item.request, "trace_context", None)
        if parent is None:  # untraced request (offline use): no orphan root spans
            return
        work = _Work()
        work.add(part, share, step, seconds)
        start_ns, end_ns = interval or (record.start_ns, record.end_ns)
        span = self.tracer.start_span(name, context=parent, start_time=start_ns,
                                      attributes={**attributes, **perf_attributes(work.summary(self.peaks))})
        span.end(end_time=end_ns)

    def _decode_step(self, state: _RequestState, item: Any, record: Any, text: _Totals, share: float,
                     step: _Totals, seconds: float) -> None:
        parent = getattr(item.request, "trace_context", None)
        if state.decode_span is None and parent is not None:
            state.decode_span = self.tracer.start_span(DECODE_SPAN, context=parent, start_time=record.start_ns)
        state.decode_work.add(text, share, step, seconds)
        if getattr(item, "draft_tokens", 0):
            state.draft_tokens += item.draft_tokens
            state.accepted_drafts += item.accepted_drafts
            state.verify_chunks += 1

    def _step_span(self, record: Any, step: PerfBreakdown, mfu: float, mbu: float) -> None:
        links = []
        for item in record.items:
            parent = getattr(item.request, "trace_context", None)
            ctx = trace.get_current_span(parent).get_span_context() if parent is not None else None
            if ctx is not None and ctx.is_valid:
                links.append(Link(ctx, {"mmserve.request.id": item.request_id}))
        prefill = sum(i.num_tokens for i in record.items if i.is_prefill)
        decode = sum(i.num_tokens for i in record.items if not i.is_prefill)
        span = self.tracer.start_span(STEP_SPAN, context=trace.set_span_in_context(trace.INVALID_SPAN),
                                      start_time=record.start_ns, links=links, attributes={
            "mmserve.step.index": record.step_index, "mmserve.step.num_requests": len(record.items),
            "mmserve.step.prefill_tokens": prefill, "mmserve.step.decode_tokens": decode,
            "mmserve.step.frames_encoded": sum(i.num_frames_encoded for i in record.items),
            "mmserve.step.emitted_tokens": sum(getattr(i, "emitted_tokens", 0) for i in record.items),
            "mmserve.step.draft_rows": sum(getattr(i, "draft_rows", 0) for i in record.items),
            "mmserve.step.num_running": record.num_running, "mmserve.step.num_waiting": record.num_waiting,
            "mmserve.step.kv_usage": record.kv_usage,
            "mmserve.perf.flops": step.total_flops, "mmserve.perf.read_bytes": step.total_read_bytes,
            "mmserve.perf.write_bytes": step.total_write_bytes, "mmserve.perf.mfu": mfu, "mmserve.perf.mbu": mbu,
            "mmserve.perf.attn_flops.sliding": step.attn_flops_sliding,
            "mmserve.perf.attn_flops.full": step.attn_flops_full,
            "mmserve.perf.comm_bytes": step.total_comm_bytes,
            "mmserve.perf.peak_flops": self.peaks.flops, "mmserve.perf.peak_bandwidth": self.peaks.bandwidth,
            "mmserve.attention.kept_pairs.sliding": step.kept_pairs_sliding,
            "mmserve.attention.kept_pairs.full": step.kept_pairs_full,
        })
        span.end(end_time=record.end_ns)


def _encode_interval(record: Any) -> tuple[int, int, float]:
    """(start ns, end ns, seconds) of the step's vision encoder call, or (0, 0, 0.0) when not timed.
    The engine times it with perf_counter; the step's (start_perf, start_ns) pair maps it to epoch ns."""
    start, end = record.encode_start_perf, record.encode_end_perf
    if start is None or end is None or end <= start:
        return 0, 0, 0.0
    offset = record.start_ns - round(record.start_perf * 1e9)
    return offset + round(start * 1e9), offset + round(end * 1e9), end - start


def _context(request: Any) -> Any:
    """The request's trace context (its `mmserve.generate` span): histograms recorded in it carry the
    trace id as an exemplar when the trace is sampled."""
    return getattr(request, "trace_context", None)


def request_work(item: Any) -> RequestWork:
    """One scheduled item of a step record as the perf model bills it."""
    request = item.request
    # the ranges that attend within themselves: images and frames (audio is causal)
    ranges_np = getattr(request, "vision_ranges_np", None)
    if ranges_np is None:
        ranges_np = np.asarray(getattr(request, "mm_ranges", ()))
    ranges = tuple(map(tuple, ranges_np.reshape(-1, 2).tolist())) if len(ranges_np) else ()
    # A prefill chunk samples when it reaches the request's last known token (the engine calls
    # on_step before appending this step's token; after preemption that includes earlier outputs).
    # A live session's context (an open prompt) never samples: billed as the prefill chunk it is.
    known = getattr(request, "num_tokens", 0)
    samples = not getattr(request, "open_prompt", 0) and (not item.is_prefill or item.context_len >= known)
    return RequestWork(item.num_tokens, item.context_len, item.is_prefill, ranges, samples=samples)


def draft_work(record: Any) -> tuple[DraftWork, ...]:
    """The drafting after a step, per request that drafted (constrained: its drafts are masked by
    its grammar, on rank 0 under tensor parallelism)."""
    return tuple(DraftWork(i.draft_rows, i.draft_keys, _constrained(i.request))
                 for i in record.items if getattr(i, "draft_rows", 0))


def _constrained(request: Any) -> bool:
    return getattr(getattr(request, "sampling_params", None), "response_format", None) is not None


def _end(span: Span, error: BaseException | None) -> None:
    if error is not None:
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, str(error) or type(error).__name__))
    span.end()


def _finish_label(finish_reason: str | None, error: BaseException | None) -> str:
    """`mmserve_requests_finished_total`'s reason: the core's ("eos", "length", "stop"); "abort" when the
    client cancelled or an Abort ended it, so a dashboard tells disconnects from "error" (the engine failed)."""
    if isinstance(error, RequestAbortedError):
        return "abort"
    return "error" if error is not None else finish_reason or "unknown"
