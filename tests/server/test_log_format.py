"""`--log-format json`: every line a real server writes is one JSON object, and a request's lines
carry its request id and the trace id of the caller's traceparent."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import uuid

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from mmserve.clients import Client
from mmserve.logs import JsonFormatter, bind_request, unbind_request
from mmserve.metrics.tracing import inject_trace_context


def _record(message: str, exc_info=None) -> logging.LogRecord:
    return logging.LogRecord("mmserve.test", logging.WARNING, __file__, 1, message, (), exc_info)


def test_json_formatter_adds_the_request_ids_only_inside_a_request():
    span = TracerProvider().get_tracer("t").start_span("request")
    formatter = JsonFormatter()
    outside = json.loads(formatter.format(_record("before")))
    assert outside["message"] == "before" and outside["level"] == "WARNING" and outside["logger"] == "mmserve.test"
    assert not {"request_id", "trace_id", "span_id"} & outside.keys()
    request_id = uuid.uuid4().hex
    token = bind_request(request_id, span)
    try:
        inside = json.loads(formatter.format(_record('a "quoted"\nmessage')))
    finally:
        unbind_request(token)
    ctx = span.get_span_context()
    assert inside["message"] == 'a "quoted"\nmessage'
    assert (inside["request_id"], inside["trace_id"], inside["span_id"]) == (
        request_id, format(ctx.trace_id, "032x"), format(ctx.span_id, "016x"))
    assert "request_id" not in json.loads(formatter.format(_record("after")))
    try:
        raise ValueError("boom")
    except ValueError:
        line = formatter.format(_record("failed", sys.exc_info()))
    assert "\n" not in line and "ValueError: boom" in json.loads(line)["exception"]


@pytest.mark.slow
def test_real_server_writes_json_lines_with_the_requests_trace_id():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "mmserve.cli", "--log-format", "json", "serve", "--port", "0",
                             "--device", "cpu"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines: list[dict] = []

    def read_until(predicate) -> dict:
        for raw in proc.stderr:
            lines.append(json.loads(raw))  # every line must be one JSON object
            if predicate(lines[-1]):
                return lines[-1]
        pytest.fail(f"server exited ({proc.poll()}) before the expected line; got {lines[-5:]}")

    try:
        listening = read_until(lambda entry: entry["message"].startswith("listening on "))
        port = int(re.search(r":(\d+) ", listening["message"]).group(1))
        read_until(lambda entry: entry["message"].startswith("ready: "))
        client_span = TracerProvider().get_tracer("client").start_span("client.generate")
        metadata = inject_trace_context(context=trace.set_span_in_context(client_span))
        request_id = f"json-log-{uuid.uuid4().hex[:8]}"
        with Client(f"127.0.0.1:{port}", timeout=60, metadata=metadata) as client:
            client.generate(prompt="Hello", max_tokens=2, request_id=request_id)
        finished = read_until(lambda entry: entry.get("request_id") == request_id)
        assert finished["trace_id"] == format(client_span.get_span_context().trace_id, "032x")
        assert len(finished["span_id"]) == 16 and "finished" in finished["message"]
        assert all("request_id" not in entry for entry in lines if entry["message"].startswith(("listening", "ready")))
    finally:
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=60)
    for raw in rest.splitlines():
        json.loads(raw)
