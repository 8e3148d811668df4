"""`mmserve traces`: spans sent by the real OpenTelemetry OTLP/gRPC exporter arrive and print as the tree
they form (a client span, the server span under it, its children), with an orphan marked as such."""

from __future__ import annotations

import io

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

from mmserve.clients.trace_viewer import TraceViewer, serve


def test_received_spans_print_as_their_tree():
    out = io.StringIO()
    viewer = TraceViewer(out, settle_s=0.0)
    server, port = serve(viewer, "127.0.0.1:0")
    try:
        def tracer(service: str):
            provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}))
            provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"http://127.0.0.1:{port}",
                                                                             insecure=True)))
            return provider, provider.get_tracer("test")

        client, client_tracer = tracer("mmserve-client")
        served, server_tracer = tracer("mmserve")
        with client_tracer.start_as_current_span("mmserve.client.generate") as root:
            with server_tracer.start_as_current_span("mmserve.generate") as generate:
                generate.set_attribute("mmserve.perf.mfu", 0.0123)
                with server_tracer.start_as_current_span("mmserve.prefill"):
                    pass
                with server_tracer.start_as_current_span("mmserve.decode"):
                    pass
        trace_id = f"{root.get_span_context().trace_id:032x}"
        lost = SpanContext(root.get_span_context().trace_id, 0xABC, is_remote=True, trace_flags=TraceFlags(1))
        with server_tracer.start_as_current_span("mmserve.generate", context=set_span_in_context(NonRecordingSpan(lost))):
            pass
        client.shutdown()
        served.shutdown()
        viewer.print_settled()
    finally:
        server.stop(0)
    lines = out.getvalue().splitlines()
    assert lines[0] == f"trace {trace_id} (5 spans)", lines
    names = [line.split("  [")[0] for line in lines[1:5]]
    assert names == ["mmserve.client.generate", "└── mmserve.generate", "    ├── mmserve.prefill",
                     "    └── mmserve.decode"], lines
    assert "[mmserve-client]" in lines[1] and "[mmserve]" in lines[2] and "mfu=0.0123" in lines[2]
    assert lines[5].startswith("mmserve.generate  [mmserve]") and "(parent 0000000000000abc not received)" in lines[5]
