"""Process logging: plain text for people, or one JSON object per line for log pipelines.

`--log-format json` makes every record a single-line JSON object (time, level, logger, message,
exception) and, inside a request, adds its `request_id`, `trace_id` and `span_id`, so a log line
and the request's trace in Jaeger find each other. The server marks the request it is handling with
`bind_request`; without it the current OpenTelemetry span, if any, supplies the trace ids.
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging

from opentelemetry import trace

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_request: contextvars.ContextVar[tuple[str, trace.SpanContext | None] | None] = contextvars.ContextVar(
    "mmserve_request", default=None)


def bind_request(request_id: str, span: trace.Span | None = None) -> contextvars.Token:
    """Log records made from now on in this context (this task or thread) carry the request's ids;
    `unbind_request(token)` ends that."""
    return _request.set((request_id, span.get_span_context() if span is not None else None))


def unbind_request(token: contextvars.Token) -> None:
    try:
        _request.reset(token)
    except ValueError:  # reset from another context (an async generator's finalizer): nothing to undo
        pass


def _ids() -> dict[str, str]:
    current = _request.get()
    request_id, ctx = current if current is not None else ("", None)
    if ctx is None:
        ctx = trace.get_current_span().get_span_context()
    ids = {"request_id": request_id} if request_id else {}
    if ctx is not None and ctx.is_valid:
        ids.update(trace_id=format(ctx.trace_id, "032x"), span_id=format(ctx.span_id, "016x"))
    return ids


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **_ids(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Root logging for a command: `fmt` is "text" or "json"."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r}: use one of {LOG_FORMATS}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
