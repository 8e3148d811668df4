"""The mmserve.v1.Generation servicer: a thin translation between gRPC and the engine.

Validation, input processing and generation all live below; this file only moves messages and
makes sure every request ends exactly once: with a Final, with a status from `status.py`, or,
when the client goes away (cancel, deadline), with an abort in the engine so nothing is leaked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from mmserve.api import pb, pb_grpc
from mmserve.config import EngineConfig
from mmserve.engine.input.processor import InputProcessor
from mmserve.engine.types import RequestOutput
from mmserve.errors import EngineUnavailableError
from mmserve.ipc.protocol import TokenLogprobs
from mmserve.logs import bind_request, unbind_request
from mmserve.metrics.tracing import end_request_span, set_request_attributes, start_request_span
from mmserve.sampling_params import SamplingParams, check_vocab
from mmserve.server.in_flight import InFlightRequests, caller_key
from mmserve.server.media import MediaService
from mmserve.server.status import abort_with, end_with
from mmserve.server.validation import check_response_format, validate_request

logger = logging.getLogger(__name__)

FINISH_REASONS = {
    "length": pb.FINISH_REASON_LENGTH,
    "eos": pb.FINISH_REASON_EOS,
    "stop": pb.FINISH_REASON_STOP_STRING,
}


TokenText = Callable[[int], str]


def logprobs_messages(entries: Sequence[TokenLogprobs], text: TokenText) -> list[pb.TokenLogprobs]:
    """Engine logprobs (ids and floats) -> wire messages with each token's text."""
    return [pb.TokenLogprobs(token_id=e.token_id, text=text(e.token_id), logprob=e.logprob, rank=e.rank,
                             top=[pb.TopLogprob(token_id=t, text=text(t), logprob=v)
                                  for t, v in zip(e.top_ids, e.top_logprobs, strict=True)])
            for e in entries]


def final_message(out: RequestOutput, text: TokenText = str, samples: Sequence[RequestOutput] = ()) -> pb.Final:
    """The Final of a request: `out` is sample 0's last output; with n > 1, `samples` are every
    sample's (index order): usage then counts the prompt once and all samples' completion tokens,
    perf sums the samples' shares of the work, and end_to_end_s is the last sample's."""
    final = pb.Final(finish_reason=FINISH_REASONS.get(out.finish_reason or "", pb.FINISH_REASON_UNSPECIFIED),
                     matched_stop=out.matched_stop or "", finish_detail=out.finish_detail or "",
                     prompt_logprobs=logprobs_messages(out.prompt_logprobs or (), text))
    if out.usage is not None:
        final.usage.CopyFrom(pb.Usage(**dataclasses.asdict(out.usage)))   # engine and wire share field names
    if len(samples) > 1:
        final.usage.completion_tokens = sum(s.usage.completion_tokens for s in samples if s.usage)
        final.samples.extend(pb.SampleFinal(
            index=i, finish_reason=FINISH_REASONS.get(s.finish_reason or "", pb.FINISH_REASON_UNSPECIFIED),
            matched_stop=s.matched_stop or "", completion_tokens=s.usage.completion_tokens if s.usage else 0,
            finish_detail=s.finish_detail or "") for i, s in enumerate(samples))
    if out.timings is not None:
        final.timings.CopyFrom(pb.Timings(**{k: v or 0.0 for k, v in dataclasses.asdict(out.timings).items()}))
        final.timings.end_to_end_s = max((s.timings.end_to_end_s or 0.0 for s in samples if s.timings),
                                         default=final.timings.end_to_end_s)
    perf_fields = {f.name for f in pb.Perf.DESCRIPTOR.fields}
    perf: dict[str, float] = {}
    for s in samples or (out,):
        for k, v in s.perf.items():
            if k in perf_fields and v is not None:
                perf[k] = perf.get(k, 0.0) + float(v)
    final.perf.CopyFrom(pb.Perf(**perf))
    final.videos.extend(pb.SampledVideo(part=v.part, num_frames=len(v.timestamps_s), timestamps_s=v.timestamps_s,
                                        duration_s=v.duration_s) for v in out.videos or ())
    return final


def _describe(span, sampling: SamplingParams, out: RequestOutput) -> None:
    usage, timings = out.usage, out.timings
    set_request_attributes(
        span, max_tokens=sampling.max_tokens, temperature=sampling.temperature,
        input_tokens=usage.prompt_tokens if usage else None, output_tokens=usage.completion_tokens if usage else None,
        finish_reasons=[out.finish_reason] if out.finish_reason else [],
        time_in_queue=timings.queue_s if timings else None,
        time_to_first_token=timings.time_to_first_token_s if timings else None,
        preprocess=timings.preprocess_s if timings else None,
        num_frames=usage.num_frames if usage else None, num_mm_tokens=usage.multimodal_tokens if usage else None,
        perf={k: float(v) for k, v in out.perf.items() if isinstance(v, int | float)})


@functools.cache
def _token_texts(tokenizer) -> TokenText:
    """A cached id -> text lookup for logprobs (special tokens shown by name), one per tokenizer."""
    if tokenizer is None:
        return str
    return functools.lru_cache(maxsize=1 << 16)(lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False))


def _log_finished(request_id: str, out: RequestOutput) -> None:
    """The access-log line of a finished request (with --log-format json it carries the trace id)."""
    usage, timings = out.usage, out.timings
    logger.info("request %s finished (%s): %d prompt tokens (%d frames), %d generated, TTFT %.3fs, e2e %.3fs",
                request_id, out.finish_reason, usage.prompt_tokens if usage else 0, usage.num_frames if usage else 0,
                usage.completion_tokens if usage else 0, (timings and timings.time_to_first_token_s) or 0.0,
                (timings and timings.end_to_end_s) or 0.0)


class GenerationServicer(pb_grpc.GenerationServicer):
    """`processor()` returns the InputProcessor once the model is loaded (None before)."""

    def __init__(self, engine, config: EngineConfig, processor: Callable[[], InputProcessor | None],
                 draining: Callable[[], bool], media: MediaService, in_flight: InFlightRequests,
                 live_observer=None) -> None:
        self._engine = engine
        self._config = config
        self._processor = processor
        self._draining = draining
        self._media = media
        self._in_flight = in_flight   # shared with the VllmEngine door: one id namespace
        from mmserve.server.live import LiveService  # live.py builds on this module's Final mapping

        self.live = LiveService(engine, config, processor, draining, in_flight, observer=live_observer)

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        request_id = request.request_id
        try:
            validated = validate_request(request, self._config)
            request_id = validated.request_id
            processor = self._processor()
            if processor is None:
                raise EngineUnavailableError("the model is still loading; retry shortly")
            check_vocab(validated.sampling, processor.spec.vocab_size)
            # Registered before the first await, so an Abort from here on finds it.
            self._in_flight.add(request_id, caller_key(context), validated.sampling.n)
        except Exception as e:  # noqa: BLE001 - a bug in a check leaves INTERNAL (logged), never a bare UNKNOWN
            end_with(context, e, request_id)   # not abort_with: no cycle keeps this request's media
            return
        try:
            with self._in_flight.checking(request_id):
                await self._in_flight.before_engine(request_id, check_response_format(   # off the loop
                    validated.sampling.response_format, processor, self._config))
                media = self._media.lease(validated.messages)  # held until the request ends
        except Exception as e:  # noqa: BLE001 - refused, aborted, or a bug: a mapped status
            end_with(context, e, request_id)
            return
        span, trace_context = start_request_span(context.invocation_metadata(), request_id=request_id,
                                                 model=self._engine.model_info.name)
        log_ids = bind_request(request_id, span)  # this request's log lines carry its ids
        final: RequestOutput | None = None
        error: Exception | None = None
        try:
            engine_request = await self._in_flight.preprocess(request_id, processor.process(
                request_id, media.messages, validated.sampling, priority=validated.priority,
                trace_context=trace_context))
            text = _token_texts(processor.tokenizer)
            ends: dict[int, RequestOutput] = {}
            # closed on leaving, so a cancel at a yield below stops every sample at once, not when collected
            async with contextlib.aclosing(self._in_flight.generate(request_id, engine_request)) as outputs:
                async for index, out in outputs:
                    if out.new_token_ids or out.new_text:
                        yield pb.GenerateResponse(request_id=request_id, delta=pb.Delta(
                            token_ids=out.new_token_ids, text=out.new_text, index=index,
                            logprobs=logprobs_messages(out.new_logprobs or (), text)))
                    if out.finished:
                        ends[index] = out
                        if len(ends) == validated.sampling.n:
                            final = ends[0]
                            samples = [ends[i] for i in range(len(ends))]
                            yield pb.GenerateResponse(request_id=request_id,
                                                      final=final_message(final, text, samples))
        except Exception as e:  # noqa: BLE001 - every failure leaves as a mapped status, never a bare UNKNOWN
            error = e  # the engine ended it, never admitted it, or input processing failed
            end_with(context, e, request_id)
        finally:
            media.release()
            if final is None and error is None:
                # Client cancel, deadline or server stop: the task is torn down mid-stream. Every
                # sample still in the engine is aborted now (its generator would, but only when collected).
                logger.info("request %s ended by the client or the server stopping; aborting it", request_id)
                self._in_flight.abort(request_id, owner=None)
            self._in_flight.remove(request_id)
            if final is not None:
                _describe(span, validated.sampling, final)
                _log_finished(request_id, final)
            end_request_span(span, error=error, cancelled=final is None and error is None)
            unbind_request(log_ids)
            # The error's traceback holds this frame, which holds the error: a cycle that kept a
            # refused request's media (decode_video's frames hold the bytes) until a full collection.
            error = None

    async def Live(self, requests: AsyncIterator[pb.LiveRequest],
                   context: grpc.aio.ServicerContext) -> AsyncIterator[pb.LiveResponse]:
        async with contextlib.aclosing(self.live.live(requests, context)) as responses:
            async for response in responses:
                yield response

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        """Abort the caller's own request with exactly this id (another key's request is not found)."""
        return pb.AbortResponse(found=self._in_flight.abort(request.request_id, caller_key(context)))

    async def UploadMedia(self, request_iterator: AsyncIterator[pb.UploadMediaRequest],
                          context: grpc.aio.ServicerContext) -> pb.MediaRef:
        return await self._media.upload(request_iterator, context)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        if self._processor() is None:
            await abort_with(context, EngineUnavailableError("the model is still loading; retry shortly"))
        info = self._engine.model_info
        peaks = info.peaks
        model_info = pb.ModelInfo(
            model_name=info.name, context_length=info.context_length,
            max_frames_per_video=self._config.max_frames_per_video,
            max_frames_per_request=self._config.max_frames_per_request,
            tokens_per_frame=info.tokens_per_frame, supported_inputs=list(self._processor().spec.modalities),
            attention_backend=info.backend, dtype=info.dtype,
            peaks=pb.DevicePeaks(device=peaks.name, flops=peaks.flops, bandwidth=peaks.bandwidth,
                                 source=peaks.source, spread=peaks.spread) if peaks else None,
            backend_checks=[pb.BackendCheck(component=c.component, selected=c.selected, running=c.running,
                                            reason=c.reason) for c in info.backend_checks],
            tensor_parallel_size=self._config.tensor_parallel_size,
            num_speculative_tokens=self._config.num_speculative_tokens if self._config.speculative_model else 0)
        if (kv := info.kv_capacity) is not None:
            model_info.kv_cache.CopyFrom(pb.KvCacheCapacity(
                pool_tokens=kv.pool_tokens, full_context_requests=kv.full_context_requests, num_bytes=kv.num_bytes,
                max_num_seqs=kv.max_num_seqs, sized_by=kv.sized_by))
        self._media.describe(model_info)
        return model_info

    async def GetServerLoad(self, request: pb.GetServerLoadRequest,
                            context: grpc.aio.ServicerContext) -> pb.ServerLoad:
        draining = self._draining()
        if self._processor() is None:
            return pb.ServerLoad(draining=draining, max_num_seqs=self._config.max_num_seqs)
        load = self._engine.load()
        return pb.ServerLoad(running_requests=load.running, waiting_requests=load.waiting,
                             kv_cache_usage=load.kv_usage, draining=draining, max_num_seqs=load.max_num_seqs,
                             kv_cache_cached_usage=load.kv_cached_usage)
