"""`mmserve traces`: see a request's span tree without Jaeger (no container, nothing to install).

An OTLP/gRPC receiver on 127.0.0.1:4317 (the port exporters default to) that prints each trace as a
tree once no span of it has arrived for a few seconds (the server exports in batches every 5 s):
the client's span (`mmserve generate --trace`), the server's `mmserve.generate` under it, and its
decode, encode, prefill and decode children, with durations and MFU/MBU. Spans that arrive later
reprint their trace. docs/tracing.md shows the three commands.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections import defaultdict
from concurrent import futures
from dataclasses import dataclass
from typing import TextIO

SETTLE_S = 6.0   # a trace is printed once it has been this quiet (longer than an exporter's 5 s batches)
SHOWN_ATTRIBUTES = ("mmserve.request.id", "mmserve.perf.mfu", "mmserve.perf.mbu", "mmserve.step.num_tokens",
                    "error.type")


@dataclass(frozen=True)
class Span:
    name: str
    service: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    attributes: dict


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind in ("string_value", "int_value", "double_value", "bool_value") else None


class TraceViewer:
    """Collects exported spans by trace; `tree(trace_id)` renders one, `print_settled` those gone quiet."""

    def __init__(self, out: TextIO = sys.stdout, settle_s: float = SETTLE_S) -> None:
        self.out, self.settle_s = out, settle_s
        self._spans: dict[str, list[Span]] = defaultdict(list)
        self._changed: dict[str, float] = {}   # trace id -> when its last span came, until printed
        self._lock = threading.Lock()

    def add(self, request) -> None:
        """An ExportTraceServiceRequest's spans."""
        now = time.monotonic()
        with self._lock:
            for resource_spans in request.resource_spans:
                service = next((_value(kv.value) for kv in resource_spans.resource.attributes
                                if kv.key == "service.name"), "?")
                for scope in resource_spans.scope_spans:
                    for s in scope.spans:
                        self._spans[s.trace_id.hex()].append(Span(
                            s.name, service, s.span_id.hex(), s.parent_span_id.hex(), s.start_time_unix_nano,
                            s.end_time_unix_nano, {kv.key: _value(kv.value) for kv in s.attributes}))
                        self._changed[s.trace_id.hex()] = now

    def tree(self, trace_id: str) -> str:
        with self._lock:
            spans = sorted(self._spans.get(trace_id, ()), key=lambda s: s.start_ns)
        ids = {s.span_id for s in spans}
        children = defaultdict(list)
        for s in spans:
            children[s.parent_id if s.parent_id in ids else ""].append(s)
        lines = [f"trace {trace_id} ({len(spans)} spans)"]

        def walk(span: Span, prefix: str, last: bool, root: bool) -> None:
            extra = "  ".join(f"{k.rsplit('.', 1)[-1]}={_shown(v)}" for k, v in span.attributes.items()
                              if k in SHOWN_ATTRIBUTES)
            orphan = f"  (parent {span.parent_id} not received)" if root and span.parent_id else ""
            branch = "" if root else ("└── " if last else "├── ")
            lines.append(f"{prefix}{branch}{span.name}  [{span.service}]  {(span.end_ns - span.start_ns) / 1e6:.1f} ms"
                         f"{'  ' + extra if extra else ''}{orphan}")
            below = prefix + ("" if root else ("    " if last else "│   "))
            for k, child in enumerate(children[span.span_id]):
                walk(child, below, k == len(children[span.span_id]) - 1, False)

        for root in children[""]:
            walk(root, "", True, True)
        return "\n".join(lines)

    def print_settled(self) -> None:
        now = time.monotonic()
        with self._lock:
            quiet = [t for t, when in self._changed.items() if now - when >= self.settle_s]
            for t in quiet:
                del self._changed[t]
        for t in quiet:
            self.out.write(self.tree(t) + "\n\n")
            self.out.flush()


def _shown(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def serve(viewer: TraceViewer, address: str):
    """A started grpc server receiving OTLP traces at `address` into `viewer`; returns (server, port)."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class Traces(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            viewer.add(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
    port = server.add_insecure_port(address)
    if not port:
        raise OSError(f"cannot listen on {address}")
    server.start()
    return server, port


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("traces", help="receive OTLP traces and print each request's span tree (no Jaeger "
                              "needed)", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen", default="127.0.0.1:4317",
                   help="HOST:PORT to receive OTLP/gRPC on; point OTEL_EXPORTER_OTLP_ENDPOINT at it (default 127.0.0.1:4317)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    viewer = TraceViewer()
    try:
        server, port = serve(viewer, args.listen)
    except (OSError, RuntimeError) as e:
        print(f"mmserve traces: {e}", file=sys.stderr)
        return 1
    print(f"receiving OTLP traces on {args.listen.rsplit(':', 1)[0]}:{port}; each trace prints {SETTLE_S:g} s "
          "after its last span (Ctrl-C stops)", file=sys.stderr)
    try:
        while True:
            time.sleep(0.5)
            viewer.print_settled()
    except KeyboardInterrupt:
        server.stop(0)
        return 0
