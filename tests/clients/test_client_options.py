"""Client options that shape every call's metadata: API key, extra metadata, trace propagation."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from mmserve.clients import Client


def test_api_key_and_traceparent_metadata():
    span = TracerProvider().get_tracer("test").start_span("caller")
    with Client("127.0.0.1:1", api_key="k-123", trace=True, metadata=(("x-tenant", "a"),)) as client:
        with trace.use_span(span, end_on_exit=True):
            inside = dict(client._metadata)
        outside = dict(client._metadata)
    ctx = span.get_span_context()
    assert inside["authorization"] == "Bearer k-123" and inside["x-tenant"] == "a"
    version, trace_id, span_id, _flags = inside["traceparent"].split("-")
    assert (trace_id, span_id) == (format(ctx.trace_id, "032x"), format(ctx.span_id, "016x"))
    assert "traceparent" not in outside  # no current span, nothing to propagate
    with Client("127.0.0.1:1") as plain:
        assert dict(plain._metadata) == {}

