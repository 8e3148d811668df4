"""Tracing setup from the standard environment and W3C context propagation over gRPC metadata."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from mmserve.metrics.tracing import (
    configure_tracing,
    extract_trace_context,
    inject_trace_context,
    traces_endpoint,
    video_decode_span,
)

OTEL_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL",
             "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")


@pytest.fixture
def clean_env(monkeypatch):
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_endpoint_and_protocol_from_env(clean_env):
    assert traces_endpoint() is None
    assert configure_tracing(set_global=False) is None
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    assert traces_endpoint() == ("grpc", "http://collector:4317")
    assert traces_endpoint("http://explicit:4317") == ("grpc", "http://explicit:4317")
    clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    assert traces_endpoint() == ("http/protobuf", "http://collector:4317/v1/traces")
    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4318/custom")
    assert traces_endpoint() == ("http/protobuf", "http://traces:4318/custom")
    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "thrift")
    with pytest.raises(ValueError, match="grpc or http/protobuf"):
        traces_endpoint()


def test_http_protobuf_provider_is_built(clean_env):
    clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    provider = configure_tracing("http://127.0.0.1:9", service_name="svc", set_global=False)
    try:
        assert provider.resource.attributes["service.name"] == "svc"
    finally:
        provider.shutdown()


def test_traceparent_round_trip_through_metadata():
    span = TracerProvider().get_tracer("t").start_span("client")
    metadata = inject_trace_context([("x-api-key", "secret")], trace.set_span_in_context(span))
    assert metadata[0] == ("x-api-key", "secret")
    extracted = trace.get_current_span(extract_trace_context(metadata + [("blob-bin", b"\x00")])).get_span_context()
    assert (extracted.trace_id, extracted.span_id) == (span.get_span_context().trace_id, span.get_span_context().span_id)
    assert extracted.is_remote
    assert not trace.get_current_span(extract_trace_context([("x-api-key", "k")])).get_span_context().is_valid
    assert not trace.get_current_span(extract_trace_context(None)).get_span_context().is_valid


def test_video_decode_span_records_failures():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    parent = tracer.start_span("mmserve.generate")
    with pytest.raises(ValueError):
        with video_decode_span(trace.set_span_in_context(parent), num_bytes=123, tracer=tracer):
            raise ValueError("not a video")
    (span,) = exporter.get_finished_spans()
    assert span.name == "mmserve.video.decode" and span.parent.span_id == parent.get_span_context().span_id
    assert span.status.status_code == StatusCode.ERROR and span.attributes["mmserve.video.input_bytes"] == 123
