"""The vllm.grpc.engine.VllmEngine servicer: a second front door onto the same engine.

A gateway (SMG, llm-d) renders the chat template and tokenizes; we take its ids, decode the media
it forwards by reference with our own pipeline and expand each anchor into our frame/image layout
(`InputProcessor.process_tokens`), or take media it preprocessed itself when they are our layout
(`mm_inputs.py`), then run the request through the same AsyncEngine as `mmserve.v1`. Admission, limits, API keys, TLS, drain and metrics are the server's, shared with
the other door; errors leave through `server/status.py`, so a cause gets the same status here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from mmserve.config import EngineConfig, ServerConfig
from mmserve.engine.input.processor import InputProcessor
from mmserve.engine.routing_prompt import RoutingPrompt, gateway_routing_prompt, media_anchors
from mmserve.engine.types import EngineRequest, RequestOutput
from mmserve.errors import EngineUnavailableError, InvalidInputError, MMServeError
from mmserve.logs import bind_request, unbind_request
from mmserve.metrics.tracing import end_request_span, set_request_attributes, start_request_span
from mmserve.model.prompt import PromptLayout
from mmserve.sampling_params import check_vocab
from mmserve.server.in_flight import InFlightRequests, caller_key
from mmserve.server.status import abort_with, bounded, end_with
from mmserve.server.validation import MAX_REQUEST_ID_CHARS, check_response_format
from mmserve.server.vllm_engine import info, kv_events, outputs
from mmserve.server.vllm_engine.media_refs import WHERE as MEDIA_WHERE
from mmserve.server.vllm_engine.media_refs import frames_per_item, media_inputs
from mmserve.server.vllm_engine.mm_inputs import preprocessed_media
from mmserve.server.vllm_engine.sampling import CheckpointDefaults, map_sampling
from mmserve.server.vllm_engine.tokenizer_archive import TokenizerArchive

logger = logging.getLogger(__name__)

LOADING = "the model is still loading; retry shortly"
# A gateway's id is the client's x-request-id with its own suffix appended: room for both.
MAX_GATEWAY_REQUEST_ID_CHARS = 2 * MAX_REQUEST_ID_CHARS


class VllmEngineServicer(vpb_grpc.VllmEngineServicer):
    """`processor()` returns the InputProcessor once the model is loaded (None before)."""

    def __init__(self, engine, engine_config: EngineConfig, server_config: ServerConfig,
                 processor: Callable[[], InputProcessor | None], draining: Callable[[], bool],
                 in_flight: InFlightRequests) -> None:
        self._engine = engine
        self._config = engine_config
        self._server_config = server_config
        self._processor = processor
        self._draining = draining
        self._defaults = CheckpointDefaults.from_checkpoint(engine_config.model)
        self._tokenizer = TokenizerArchive(engine_config.model)
        self._in_flight = in_flight   # shared with mmserve.v1: one id namespace, Abort by owner
        self._started = time.monotonic()
        self._last_request = 0.0
        self.kv_events = kv_events.KvEventStreams(
            engine, engine_config.block_size, max_subscribers=server_config.kv_events_max_subscribers,
            max_per_client=server_config.kv_events_max_subscribers_per_client)

    def _ready(self) -> InputProcessor:
        processor = self._processor()
        if processor is None:
            raise EngineUnavailableError(LOADING)
        return processor

    async def _ready_or_abort(self, context: grpc.aio.ServicerContext) -> InputProcessor:
        """The processor, or the call ends UNAVAILABLE while the model loads."""
        try:
            return self._ready()
        except MMServeError as e:
            await abort_with(context, e)

    async def Generate(self, request: vpb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[vpb.GenerateResponse]:
        self._last_request = time.time()
        request_id = request.request_id
        try:
            processor = self._ready()
            _check_request_id(request_id)
            token_ids = _prompt_ids(request, processor)
            sampling = map_sampling(request.sampling_params, self._config, self._defaults,   # before any decode
                                    processor.spec.eos_token_ids)
            check_vocab(sampling.params, processor.spec.vocab_size)
            preprocessed = preprocessed_media(request, processor.spec) if _has_mm_inputs(request) else None
            # Registered before the first await, so an Abort from here on finds it.
            self._in_flight.add(request_id, caller_key(context), sampling.params.n)
        except Exception as e:  # noqa: BLE001 - a bug in a check leaves INTERNAL (logged), never a bare UNKNOWN
            end_with(context, e, request_id)   # as mmserve.v1's Generate: no cycle keeps the request
            return
        try:
            with self._in_flight.checking(request_id):
                media = await self._in_flight.before_engine(request_id, asyncio.to_thread(   # data: URLs, off the loop
                    media_inputs, request.media_refs, max_bytes=self._config.max_video_bytes,
                    allowed_local_media_path=self._server_config.allowed_local_media_path))
                await self._in_flight.before_engine(request_id, check_response_format(   # off the loop
                    sampling.params.response_format, processor, self._config))
        except Exception as e:  # noqa: BLE001 - refused, aborted, or a bug: a mapped status
            end_with(context, e, request_id)
            return
        span, trace_context = start_request_span(context.invocation_metadata(), request_id=request_id,
                                                 model=self._engine.model_info.name)
        log_ids = bind_request(request_id, span)
        params = sampling.params
        with_top = params.top_logprobs > 0
        ended: outputs.SampleEnds | None = None   # once the prompt is known
        error: Exception | None = None
        try:
            if preprocessed is not None:
                processing = processor.process_layout(
                    PromptLayout(token_ids, preprocessed.mm_ranges, preprocessed.mm_items), request_id, params,
                    num_frames=preprocessed.num_frames, max_tokens_to_context=sampling.max_tokens_to_context,
                    trace_context=trace_context)
            else:
                processing = processor.process_tokens(
                    request_id, token_ids, media, params, where=MEDIA_WHERE,
                    max_tokens_to_context=sampling.max_tokens_to_context, trace_context=trace_context)
            engine_request = await self._in_flight.preprocess(request_id, processing)
            context.set_trailing_metadata(outputs.sampled_frames(frames_per_item(engine_request.videos)))
            prompt = engine_request.prompt_token_ids
            engine_request.routing_prompt = _routing_prompt(
                token_ids, engine_request, processor.spec,
                [engine_request.ranges_per_part.get(f"{MEDIA_WHERE}[{k}]", 1) for k in range(len(media))])
            ended = outputs.SampleEnds(prompt, with_top)
            collected: dict[int, tuple[list[int], list]] = {}
            # closed on leaving, so a cancel at a yield below stops every sample at once, not when collected
            async with contextlib.aclosing(self._in_flight.generate(request_id, engine_request)) as samples:
                async for index, out in samples:
                    if request.stream:
                        if out.new_token_ids:
                            yield outputs.chunk(index, out, len(prompt), with_top)
                        if out.finished:
                            for message in ended.finished(index, out, out.new_token_ids, out.new_logprobs):
                                yield message
                        continue
                    ids, logprobs = collected.setdefault(index, ([], []))
                    ids.extend(out.new_token_ids)
                    logprobs.extend(out.new_logprobs or ())
                    if out.finished:
                        for message in ended.finished(index, out, ids, logprobs if params.logprobs else None):
                            yield message
        except Exception as e:  # noqa: BLE001 - every failure leaves as a mapped status
            error = e
            end_with(context, e, request_id)
        finally:
            ends = ended.ends if ended is not None else {}
            finished = len(ends) == params.n
            if not finished and error is None:
                logger.info("request %s ended by the client or the server stopping; aborting it", request_id)
                self._in_flight.abort(request_id, owner=None)
            self._in_flight.remove(request_id)
            if finished:
                _describe(span, params, ends)
            end_request_span(span, error=error, cancelled=not finished and error is None)
            unbind_request(log_ids)
            error = None   # its traceback holds this frame: a cycle keeping the request's media

    async def Abort(self, request: vpb.AbortRequest, context: grpc.aio.ServicerContext) -> vpb.AbortResponse:
        owner = caller_key(context)   # the caller's own requests only, as through mmserve.v1
        found = [rid for rid in request.request_ids if self._in_flight.abort(rid, owner)]
        if found:
            logger.info("aborted %s at the gateway's request", ", ".join(found))
        return vpb.AbortResponse()

    async def HealthCheck(self, request: vpb.HealthCheckRequest,
                          context: grpc.aio.ServicerContext) -> vpb.HealthCheckResponse:
        if self._processor() is None:
            return vpb.HealthCheckResponse(healthy=False, message=LOADING)
        if self._draining():
            return vpb.HealthCheckResponse(healthy=False, message="draining: shutting down")
        if self._engine.dead_error is not None:
            return vpb.HealthCheckResponse(healthy=False, message=f"engine died: {self._engine.dead_error}")
        return vpb.HealthCheckResponse(healthy=True, message="serving")

    async def GetModelInfo(self, request: vpb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> vpb.GetModelInfoResponse:
        processor = await self._ready_or_abort(context)
        return info.model_info(self._engine.model_info, processor.spec, self._defaults)

    async def GetServerInfo(self, request: vpb.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> vpb.GetServerInfoResponse:
        processor = await self._ready_or_abort(context)
        return info.server_info(self._config, self._server_config, self._engine.model_info, processor.spec,
                                active=len(self._in_flight), draining=self._draining(), started=self._started,
                                last_request=self._last_request)

    async def GetLoads(self, request: vpb.GetLoadsRequest, context: grpc.aio.ServicerContext) -> vpb.GetLoadsResponse:
        return info.loads(self._engine.load())

    async def GetTokenizer(self, request: common_pb2.GetTokenizerRequest,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        try:
            chunks = await self._tokenizer.chunks()
        except OSError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, bounded(f"cannot serve the tokenizer: {e}"))
        logger.info("sending the tokenizer archive (%d chunks, sha256 %s)", len(chunks), chunks[-1].sha256)
        for piece in chunks:
            yield piece

    async def SubscribeKvEvents(self, request: common_pb2.SubscribeKvEventsRequest,
                                context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """Serialized KvEventBatch messages (registered without a serializer: kv_events.py says why)."""
        async for batch in self.kv_events.subscribe(request, context):
            yield batch

    async def FlushCache(self, request: common_pb2.FlushCacheRequest,
                         context: grpc.aio.ServicerContext) -> common_pb2.FlushCacheResponse:
        return await self.kv_events.flush_cache(request, context)

    async def Embed(self, request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "embeddings are not served: this is a generative model")

    async def StartProfile(self, request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "profiling over gRPC is not supported; see "
                                                           "docs/observability.md for traces and step profiles")

    async def StopProfile(self, request, context: grpc.aio.ServicerContext):
        await self.StartProfile(request, context)


def _routing_prompt(gateway_ids: list[int], request: EngineRequest, spec,
                    ranges_per_item: list[int]) -> RoutingPrompt | None:
    """The gateway's prompt mapped onto ours, so our KV events speak its tokens (engine/kv_event_hub.py):
    media item k (the k-th anchor) became `ranges_per_item[k]` ranges (1, or one per frame sampled or
    audio segment)."""
    if not request.mm_ranges or list(gateway_ids) == list(request.prompt_token_ids):
        return None   # the same tokens as ours (text, or a prompt the gateway expanded itself)
    anchors = media_anchors(gateway_ids, _anchor_ids(spec).values(), ranges_per_item)
    if anchors is None:
        return None
    return gateway_routing_prompt(gateway_ids, request.prompt_token_ids, request.mm_ranges, anchors)


def _check_request_id(request_id: str) -> None:
    if not request_id:
        raise InvalidInputError("request_id", "the gateway must name the request (it aborts by id)")
    if len(request_id) > MAX_GATEWAY_REQUEST_ID_CHARS or not request_id.isprintable():
        raise InvalidInputError("request_id", f"at most {MAX_GATEWAY_REQUEST_ID_CHARS} printable characters "
                                              f"(the client's x-request-id at most {MAX_REQUEST_ID_CHARS})")


def _prompt_ids(request: vpb.GenerateRequest, processor: InputProcessor) -> list[int]:
    """The gateway's token ids, checked before any work: tokenized input, in the vocabulary, shorter
    than the context, one anchor per media item in order; the refused alternatives named."""
    kind = request.WhichOneof("input")
    if kind != "tokenized":
        raise InvalidInputError("text" if kind else "tokenized", "send tokenized.input_ids (the gateway renders "
                                                                  "the chat template and tokenizes)")
    if _has_mm_inputs(request) and request.media_refs.items:
        raise InvalidInputError("media_refs", "send media_refs or preprocessed mm_inputs, not both")
    if request.HasField("kv_transfer_params") or request.HasField("kv_transfer_params_json"):
        raise InvalidInputError("kv_transfer_params", "prefill/decode disaggregation is not supported")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise InvalidInputError("data_parallel_rank", "this worker has one rank, 0")
    ids = list(request.tokenized.input_ids)
    spec = processor.spec
    where = "tokenized.input_ids"
    if not ids:
        raise InvalidInputError(where, "the prompt is empty")
    if len(ids) >= processor.max_model_len:
        raise InvalidInputError(where, f"{len(ids)} tokens, the context length is {processor.max_model_len}")
    if (bad := max(ids)) >= processor.tokenizer.vocab_size:
        raise InvalidInputError(where, f"token id {bad} is outside the vocabulary (size {processor.tokenizer.vocab_size})")
    if _has_mm_inputs(request):
        if not spec.has_vision:   # else tensors of a valid layout would reach a model with no vision tower
            raise InvalidInputError("mm_inputs", "this model takes no images or video")
        if any(b.modality == common_pb2.AUDIO for b in (request.mm_inputs, *request.extra_mm_inputs)):
            raise InvalidInputError("mm_inputs", "preprocessed audio is not taken: send the clip in media_refs "
                                                 "(this worker decodes audio and computes its features itself)")
        return ids   # expanded by the gateway: preprocessed_media checks the layout
    if not spec.has_audio and any(m.modality == common_pb2.AUDIO for m in request.media_refs.items):
        raise InvalidInputError(MEDIA_WHERE, f"{processor.model_name} has no audio tower: it takes "
                                             f"{', '.join(spec.modalities)}")
    anchor_of = _anchor_ids(spec)
    anchors = [t for t in ids if t in anchor_of.values()]
    items = [anchor_of.get(m.modality) for m in request.media_refs.items]
    if anchors != items:
        raise InvalidInputError(MEDIA_WHERE, f"the prompt holds {len(anchors)} media anchors, the request "
                                             f"{len(items)} media items; they must pair one to one, in order")
    if not spec.has_vision and set(anchors) & {spec.image_token_id, spec.video_token_id}:
        raise InvalidInputError(MEDIA_WHERE, "this model takes no images or video")
    return ids


def _anchor_ids(spec) -> dict[int, int]:
    """Modality -> the one token a gateway's rendered prompt holds per item of it (audio: E-models only)."""
    anchors = {common_pb2.IMAGE: spec.image_token_id, common_pb2.VIDEO: spec.video_token_id}
    if spec.has_audio:
        anchors[common_pb2.AUDIO] = spec.audio_token_id
    return anchors


def _has_mm_inputs(request: vpb.GenerateRequest) -> bool:
    return request.HasField("mm_inputs") or bool(request.extra_mm_inputs)


def _describe(span, params, ends: dict[int, RequestOutput]) -> None:
    """Span attributes and the access-log line, from sample 0's end (usage over all samples)."""
    out = ends[0]
    usage, timings = out.usage, out.timings
    completion = sum(e.usage.completion_tokens for e in ends.values() if e.usage)
    set_request_attributes(
        span, max_tokens=params.max_tokens, temperature=params.temperature,
        input_tokens=usage.prompt_tokens if usage else None, output_tokens=completion,
        finish_reasons=[e.finish_reason for e in ends.values() if e.finish_reason],
        time_in_queue=timings.queue_s if timings else None,
        time_to_first_token=timings.time_to_first_token_s if timings else None,
        num_frames=usage.num_frames if usage else None, num_mm_tokens=usage.multimodal_tokens if usage else None)
    logger.info("request %s finished (%s): %d prompt tokens (%d frames, %d cached), %d generated, TTFT %.3fs",
                out.request_id, out.finish_reason, usage.prompt_tokens if usage else 0,
                usage.num_frames if usage else 0, usage.cached_tokens if usage else 0, completion,
                (timings and timings.time_to_first_token_s) or 0.0)
