"""A real OTLP/gRPC receiver for tests: the opentelemetry-proto TraceService and MetricsService on
127.0.0.1 with an ephemeral port, collecting what exporters send.

Use the `otlp_receiver` fixture (or `OtlpReceiver()` directly) and point an exporter at
`receiver.endpoint` ("http://127.0.0.1:PORT"). Spans come back as `ReceivedSpan`s with hex ids and
plain-Python attribute values, so tests read like the span tree they check.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.sdk.trace import SpanProcessor

STATUS_ERROR = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    start_ns: int
    end_ns: int
    status_code: int
    status_message: str
    attributes: dict[str, Any]
    links: list[tuple[str, str]]  # (trace_id, span_id)
    resource: dict[str, Any] = field(default_factory=dict)

    @property
    def is_error(self) -> bool:
        return self.status_code == STATUS_ERROR


class _Traces(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: OtlpReceiver):
        self.sink = sink

    def Export(self, request, context):
        spans = []
        for rs in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(ReceivedSpan(
                        name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(), kind=s.kind, start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano, status_code=s.status.code, status_message=s.status.message,
                        attributes={kv.key: _value(kv.value) for kv in s.attributes},
                        links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links], resource=resource))
        with self.sink.cond:
            self.sink.spans.extend(spans)
            self.sink.cond.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()


class _Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, sink: OtlpReceiver):
        self.sink = sink

    def Export(self, request, context):
        names = [m.name for rm in request.resource_metrics for sm in rm.scope_metrics for m in sm.metrics]
        with self.sink.cond:
            self.sink.metric_names.update(names)
            self.sink.metric_requests.append(request)
            self.sink.cond.notify_all()
        return metrics_service_pb2.ExportMetricsServiceResponse()


class OtlpReceiver:
    """Collects spans and metrics exported over OTLP/gRPC to `endpoint`."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.metric_names: set[str] = set()
        self.metric_requests: list[Any] = []
        self.cond = threading.Condition()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Traces(self), self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_Metrics(self), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.server.start()

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float = 10.0) -> list[ReceivedSpan]:
        """Block until predicate(spans so far) holds; returns a snapshot of the spans."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not predicate(self.spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({s.name for s in self.spans})
                    raise TimeoutError(f"OTLP receiver: condition not met in {timeout}s; got spans {names}")
                self.cond.wait(left)
            return list(self.spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self.cond:
            return [s for s in self.spans if s.trace_id == trace_id]

    def clear(self) -> None:
        with self.cond:
            self.spans.clear()
            self.metric_names.clear()
            self.metric_requests.clear()

    def stop(self) -> None:
        self.server.stop(grace=None)


class _Forwarder(SpanProcessor):
    """A span processor installed once in the process-wide TracerProvider (OTel allows setting it only
    once); it hands ended spans to whichever receiver's exporter is current, else drops them."""

    def __init__(self) -> None:
        self.target = None
        self.installed = False

    def on_end(self, span) -> None:
        if self.target is not None:
            self.target.on_end(span)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self.target.force_flush(timeout_millis) if self.target is not None else True


_FORWARDER = _Forwarder()


@contextlib.contextmanager
def global_traces_to(receiver: OtlpReceiver) -> Iterator[None]:
    """Route spans of the global tracer (what the server's request spans use) to `receiver`."""
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    if not _FORWARDER.installed:
        provider.add_span_processor(_FORWARDER)
        _FORWARDER.installed = True
    _FORWARDER.target = SimpleSpanProcessor(OTLPSpanExporter(endpoint=receiver.endpoint, insecure=True))
    try:
        yield
    finally:
        target, _FORWARDER.target = _FORWARDER.target, None
        target.shutdown()


@pytest.fixture
def otlp_receiver():
    receiver = OtlpReceiver()
    yield receiver
    receiver.stop()
