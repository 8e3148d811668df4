"""OpenTelemetry tracing: SDK setup from the standard environment, W3C context propagation over gRPC
metadata, and the request span (`mmserve.generate`) helpers the server calls.

Nothing here imports grpc: metadata is a sequence of (key, value) pairs, which is what grpc hands the
servicer (`context.invocation_metadata()`) and what a client passes as `metadata=`.

Environment (standard OTel names): OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES,
OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL (grpc | http/protobuf),
OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG. An explicit endpoint (`--otlp-traces-endpoint`) wins.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger(__name__)

TRACER_NAME = "mmserve"
REQUEST_SPAN = "mmserve.generate"
VIDEO_DECODE_SPAN = "mmserve.video.decode"
AUDIO_DECODE_SPAN = "mmserve.audio.decode"
_PROPAGATOR = TraceContextTextMapPropagator()  # W3C traceparent/tracestate, whatever OTEL_PROPAGATORS says


def _env(*names: str) -> str | None:
    for name in names:
        if value := os.environ.get(name):
            return value
    return None


def traces_endpoint(endpoint: str | None = None) -> tuple[str, str] | None:
    """(protocol, url) the exporter will use, or None when no endpoint is configured anywhere."""
    protocol = (_env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").lower()
    if protocol not in ("grpc", "http/protobuf"):
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: use grpc or http/protobuf")
    if endpoint:
        url = endpoint
    elif signal := _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return protocol, signal  # a signal-specific endpoint is used as is
    elif base := _env("OTEL_EXPORTER_OTLP_ENDPOINT"):
        url = base
    else:
        return None
    if protocol == "http/protobuf" and not url.rstrip("/").endswith("/v1/traces"):
        url = url.rstrip("/") + "/v1/traces"
    return protocol, url


def configure_tracing(endpoint: str | None = None, *, service_name: str | None = None, set_global: bool = True):
    """A TracerProvider exporting over OTLP in batches, or None when no endpoint is configured.

    The sampler comes from OTEL_TRACES_SAMPLER (default parent-based always-on), so an incoming
    sampled traceparent is always honoured.
    """
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    target = traces_endpoint(endpoint)
    if target is None:
        logger.info("tracing off: no --otlp-traces-endpoint and no OTEL_EXPORTER_OTLP_ENDPOINT")
        return None
    protocol, url = target
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=url, insecure=not url.startswith("https://"))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter

        exporter = HttpSpanExporter(endpoint=url)
    name = service_name or os.environ.get("OTEL_SERVICE_NAME") or "mmserve"
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    if set_global:
        trace.set_tracer_provider(provider)
    logger.info("tracing on: OTLP %s to %s as service %r", protocol, url, name)
    return provider


def get_tracer(provider: Any = None) -> Tracer:
    """The mmserve tracer of `provider`, else of the global provider (a no-op one when unset)."""
    return (provider or trace.get_tracer_provider()).get_tracer(TRACER_NAME)


def extract_trace_context(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context:
    """The W3C parent carried in incoming gRPC metadata (an empty context when there is none)."""
    carrier: dict[str, str] = {}
    for key, value in metadata or ():
        if isinstance(value, bytes):
            continue  # binary (-bin) headers never carry traceparent
        carrier[key.lower()] = value
    return _PROPAGATOR.extract(carrier)


def inject_trace_context(metadata: Sequence[tuple[str, str]] = (), context: Context | None = None) -> list[tuple[str, str]]:
    """`metadata` plus traceparent/tracestate of `context` (default: the current span), for a client call."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    return [*metadata, *carrier.items()]


def start_request_span(metadata: Iterable[tuple[str, str | bytes]] | None, *, request_id: str, model: str,
                       tracer: Tracer | None = None) -> tuple[Span, Context]:
    """Start `mmserve.generate` as a child of the caller's traceparent. Returns the span and the context
    to hand the engine as `request.trace_context` (its children hang below this span)."""
    tracer = tracer or get_tracer()
    span = tracer.start_span(REQUEST_SPAN, context=extract_trace_context(metadata), kind=SpanKind.SERVER,
                             attributes={"gen_ai.operation.name": "generate_content", "gen_ai.request.model": model,
                                         "mmserve.request.id": request_id})
    return span, trace.set_span_in_context(span)


def set_request_attributes(
    span: Span,
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    input_tokens: int | None = None,
    output_tokens: int | None = None,
    finish_reasons: Sequence[str] = (),
    time_in_queue: float | None = None,
    time_to_first_token: float | None = None,
    preprocess: float | None = None,
    num_frames: int | None = None,
    num_mm_tokens: int | None = None,
    perf: Mapping[str, float] | None = None,
) -> None:
    """GenAI and mmserve attributes the server sets on `mmserve.generate` when the request ends
    (values that are None are left out rather than reported as 0)."""
    values: dict[str, Any] = {
        "gen_ai.request.max_tokens": max_tokens,
        "gen_ai.request.temperature": temperature,
        "gen_ai.usage.input_tokens": input_tokens,
        "gen_ai.usage.output_tokens": output_tokens,
        "gen_ai.response.finish_reasons": list(finish_reasons) if finish_reasons else None,
        "mmserve.latency.time_in_queue": time_in_queue,
        "mmserve.latency.time_to_first_token": time_to_first_token,   # from arrival: includes preprocess
        "mmserve.latency.preprocess": preprocess,
        "mmserve.mm.num_frames": num_frames,
        "mmserve.mm.num_tokens": num_mm_tokens,
    }
    for key, value in (perf or {}).items():
        values[f"mmserve.perf.{key.replace('attn_flops_', 'attn_flops.')}"] = value
    span.set_attributes({k: v for k, v in values.items() if v is not None})


def end_request_span(span: Span, *, error: BaseException | None = None, cancelled: bool = False) -> None:
    """End a request span; cancelled and failed requests end with ERROR status and `error.type`."""
    if error is not None:
        span.record_exception(error)
        span.set_attribute("error.type", type(error).__name__)
        span.set_status(Status(StatusCode.ERROR, str(error) or type(error).__name__))
    elif cancelled:
        span.set_attribute("error.type", "cancelled")
        span.set_status(Status(StatusCode.ERROR, "cancelled"))
    span.end()


@contextlib.contextmanager
def _decode_span(name: str, kind: str, parent: Context | None, num_bytes: int, tracer: Tracer | None) -> Iterator[Span]:
    tracer = tracer or get_tracer()
    with tracer.start_as_current_span(name, context=parent, record_exception=True,
                                      set_status_on_exception=True) as span:
        span.set_attribute(f"mmserve.{kind}.input_bytes", num_bytes)
        yield span


def video_decode_span(parent: Context | None, *, num_bytes: int, tracer: Tracer | None = None):
    """Wrap one video's decode (the input processor calls this in its worker thread). The caller adds
    what it decoded with `set_video_decode_result`; an exception marks the span as an error."""
    return _decode_span(VIDEO_DECODE_SPAN, "video", parent, num_bytes, tracer)


def audio_decode_span(parent: Context | None, *, num_bytes: int, tracer: Tracer | None = None):
    """Wrap one audio part's decode, resampling and log-mel features (in the worker thread); the
    caller adds what came out with `set_audio_decode_result`. A refusal (a lying header, silence, the
    duration limit) marks the span as an error with the reason."""
    return _decode_span(AUDIO_DECODE_SPAN, "audio", parent, num_bytes, tracer)


def set_audio_decode_result(span: Span, audio: Any, segments: Sequence[Any]) -> None:
    """What one audio part's decode produced (a `multimodal.audio.DecodedAudio` and its `Segment`s):
    the clip's duration, the window heard, the samples written and what the tower will take. CPU work
    outside the model: no FLOPs here (the engine's `mmserve.audio.encode` bills the tower)."""
    span.set_attributes({
        "mmserve.audio.duration_s": float(audio.duration_s),
        "mmserve.audio.start_s": float(audio.start_s),
        "mmserve.audio.heard_s": audio.samples.size / audio.rate,
        "mmserve.audio.sample_bytes": int(audio.samples.nbytes),
        "mmserve.audio.segments": len(segments),
        "mmserve.audio.soft_tokens": int(sum(s.num_soft_tokens for s in segments)),
    })


def set_video_decode_result(span: Span, video: Any, *, sample_rate: int = 0, soundtrack: Sequence[Any] = ()) -> None:
    """What one video's decode produced (a `multimodal.video.DecodedVideo`): how frames were reached
    (seek or scan) and how many the decoder produced, the sampled frames, their size, the clip's
    duration and the RGB bytes written; with use_audio_in_video, the seconds of soundtrack heard
    (read in the same pass, at `sample_rate`) and its segments. Decoding is CPU work outside the model, so
    the span carries no FLOPs or MFU (there is nothing honest to divide)."""
    frames = video.frames
    attributes = {
        "mmserve.video.method": video.method,
        "mmserve.video.frames_decoded": int(video.frames_decoded),
        "mmserve.video.num_frames": len(frames),
        "mmserve.video.duration_s": float(video.duration_s),
        "mmserve.video.frame_bytes": int(sum(f.nbytes for f in frames)),
        "mmserve.video.rotation_deg": int(getattr(video, "rotation_deg", 0)),
        "mmserve.video.deinterlaced": bool(getattr(video, "deinterlaced", False)),
    }
    if frames:
        attributes["mmserve.video.height"], attributes["mmserve.video.width"] = map(int, frames[0].shape[:2])
    if getattr(video, "soundtrack", None) is not None and sample_rate:
        attributes["mmserve.video.soundtrack_s"] = video.soundtrack.size / sample_rate
        attributes["mmserve.video.soundtrack_segments"] = len(soundtrack)
    span.set_attributes(attributes)
