"""A real server (real engine, real model) with the TelemetryObserver, exporting spans over OTLP/gRPC
to a loopback receiver: one video request yields the span tree under the client's traceparent with
its perf attributes, the Final message carries the same perf, and a cancelled request's span is an
error. The Prometheus endpoint of the same run serves the queue gauge the HPA scales on."""

from __future__ import annotations

import asyncio
import re
import urllib.request
import uuid
from pathlib import Path

import grpc
import pytest
from grafana_dashboard import dashboard_metric_names, promql_metric_names
from loopback_server import LoopbackServer, engine_config
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from otlp_receiver import global_traces_to
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from mmserve.clients import Client
from mmserve.clients.types import ClientError
from mmserve.config import ServerConfig
from mmserve.metrics.perf_model import PerfModel
from mmserve.metrics.prometheus import EngineMetrics, start_metrics_server
from mmserve.metrics.telemetry import TelemetryObserver
from mmserve.metrics.tracing import get_tracer, inject_trace_context
from mmserve.model.spec import load_spec


@pytest.fixture(scope="module")
def traced(served_model):
    from otlp_receiver import OtlpReceiver

    receiver = OtlpReceiver()
    with global_traces_to(receiver):
        metrics = EngineMetrics(prometheus=True)
        perf = PerfModel(load_spec(served_model), dtype="float32")
        observer = TelemetryObserver(perf, tracer=get_tracer(), metrics=metrics, step_trace_ratio=1.0)
        config = engine_config(served_model, default_num_frames=2, step_trace_ratio=1.0)
        server = LoopbackServer(config, ServerConfig(port=0, worker_threads=2, drain_grace_s=5.0),
                                observer=observer, metrics=metrics).start()
        try:
            yield server, receiver, metrics
        finally:
            server.stop()
            metrics.shutdown()
    receiver.stop()


def test_video_request_span_tree(traced, make_video):
    server, receiver, _ = traced
    client_span = TracerProvider().get_tracer("client").start_span("client.generate")
    metadata = inject_trace_context(context=trace.set_span_in_context(client_span))
    request_id = f"traced-{uuid.uuid4().hex[:8]}"
    with Client(f"127.0.0.1:{server.port}", timeout=120, metadata=metadata) as client:
        result = client.generate(prompt="What happens?", video=make_video(seed=3, num_frames=6), num_frames=2,
                                 max_tokens=4, ignore_eos=True, temperature=0, request_id=request_id)
    assert len(result.token_ids) == 4

    def generate_span(spans):
        return next((s for s in spans if s.name == "mmserve.generate"
                     and s.attributes.get("mmserve.request.id") == request_id), None)

    spans = receiver.wait_for(lambda s: generate_span(s) is not None)
    root = generate_span(spans)
    ctx = client_span.get_span_context()
    assert (root.trace_id, root.parent_span_id) == (format(ctx.trace_id, "032x"), format(ctx.span_id, "016x"))
    assert not root.is_error
    attrs = root.attributes
    assert attrs["gen_ai.operation.name"] and attrs["gen_ai.request.model"]
    assert attrs["gen_ai.request.max_tokens"] == 4
    assert attrs["gen_ai.usage.output_tokens"] == 4
    assert attrs["gen_ai.usage.input_tokens"] == result.usage.prompt_tokens
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert attrs["mmserve.mm.num_frames"] == 2 and attrs["mmserve.mm.num_tokens"] == result.usage.multimodal_tokens
    assert attrs["mmserve.latency.time_to_first_token"] > 0 and "mmserve.latency.time_in_queue" in attrs

    children = [s for s in spans if s.parent_span_id == root.span_id]
    names = [s.name for s in children]
    assert names.count("mmserve.video.decode") == 1
    assert names.count("mmserve.decode") == 1
    assert names.count("mmserve.prefill") >= 1 and names.count("mmserve.vision.encode") >= 1
    for s in children:
        if s.name != "mmserve.video.decode":
            assert s.attributes["mmserve.perf.flops"] > 0 and s.attributes["mmserve.perf.mfu"] > 0, s.name
            assert "mmserve.perf.attn_flops.sliding" in s.attributes and "mmserve.perf.attn_flops.full" in s.attributes
    assert sum(s.attributes.get("mmserve.perf.flops", 0) for s in children) == pytest.approx(result.perf.flops)
    assert attrs["mmserve.perf.flops"] == pytest.approx(result.perf.flops)
    assert result.perf.mfu > 0 and result.perf.attn_flops_sliding > 0 and result.perf.attn_flops_full > 0

    steps = [s for s in receiver.spans if s.name == "mmserve.engine.step"]
    assert any((root.trace_id, root.span_id) in s.links for s in steps)


def _finished_by_reason(metrics) -> dict[str, float]:
    return {s.labels["finish_reason"]: s.value for family in text_string_to_metric_families(_scrape(metrics))
            for s in family.samples if s.name == "mmserve_requests_finished_total"}


def test_cancelled_request_span_is_an_error_and_counted_as_an_abort(traced):
    """A client's cancel ends its spans in error, and `mmserve_requests_finished_total` counts it as
    "abort", not "error" (the engine failing): the dashboard's error panel showed every disconnect."""
    server, receiver, metrics = traced
    before = _finished_by_reason(metrics)
    request_id = f"cancel-{uuid.uuid4().hex[:8]}"
    with Client(f"127.0.0.1:{server.port}", timeout=120) as client:
        stream = client.stream(prompt="Count forever.", max_tokens=200, ignore_eos=True, request_id=request_id)
        for seen, _ in enumerate(stream, 1):
            if seen == 3:  # a few decode steps ran: the request is in its decode phase
                break
        stream.cancel()

    def ended(spans, name):
        roots = [s for s in spans if s.name == "mmserve.generate" and s.attributes.get("mmserve.request.id") == request_id]
        return [s for s in spans if roots and s.parent_span_id == roots[0].span_id and s.name == name] if name else roots

    # The server ends the request span; the engine ends the decode span when it processes the abort.
    spans = receiver.wait_for(lambda s: ended(s, None) and ended(s, "mmserve.decode"), timeout=30)
    (root,) = ended(spans, None)
    assert root.is_error
    decode = ended(spans, "mmserve.decode")
    assert decode and all(s.is_error for s in decode)
    server.call(asyncio.sleep(0))   # the loop has left the observer's hook that ended the decode span
    after = _finished_by_reason(metrics)
    assert after.get("abort", 0) - before.get("abort", 0) == 1
    assert after.get("error", 0) == before.get("error", 0)


def test_prometheus_serves_the_server_metrics(traced):
    _, _, metrics = traced
    http, port = start_metrics_server(0, metrics, addr="127.0.0.1")
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        http.shutdown()
    for name in ("mmserve_requests_waiting", "mmserve_requests_running", "mmserve_time_to_first_token_seconds_count",
                 "mmserve_generation_tokens_total", "mmserve_perf_mfu"):
        assert f"\n{name}" in text, name


def test_denominators_are_exported(traced):
    """GetModelInfo and /metrics (an info metric and two gauges) say what MFU/MBU divide by: the
    peaks the engine detected."""
    server, _, metrics = traced
    peaks = server.engine.ready.peaks   # measured in the engine process, reported in READY
    with Client(f"127.0.0.1:{server.port}", timeout=30) as client:
        info = client.model_info().peaks
    assert (info.device, info.flops, info.bandwidth, info.source) == (peaks.name, peaks.flops, peaks.bandwidth,
                                                                      peaks.source)
    http, port = start_metrics_server(0, metrics, addr="127.0.0.1")
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        http.shutdown()
    samples = {s.name: s for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples["mmserve_perf_peak_flops"].value == pytest.approx(peaks.flops)
    assert samples["mmserve_perf_peak_bandwidth"].value == pytest.approx(peaks.bandwidth)
    info_sample = samples["mmserve_device_peaks_info"]
    assert info_sample.value == 1
    assert {k: info_sample.labels[k] for k in ("device", "source", "dtype")} == {
        "device": peaks.name, "source": peaks.source, "dtype": peaks.dtype}
    assert float(info_sample.labels["peak_flops"]) == pytest.approx(peaks.flops, rel=1e-5)


def test_generate_cli_trace_prints_the_id_of_the_servers_trace(traced, tmp_path, make_video):
    """`mmserve generate --trace` (a separate process exporting its own span to the same receiver)
    prints a trace id under which both its client span and the server's request tree arrive."""
    import os
    import re
    import subprocess
    import sys

    server, receiver, _ = traced
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(make_video(seed=5, num_frames=4))
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    proc = subprocess.run(
        [sys.executable, "-m", "mmserve.cli", "--log-level", "WARNING", "generate", "--server",
         f"127.0.0.1:{server.port}", "--video", str(clip), "--num-frames", "2", "--prompt", "Describe the video.",
         "--max-tokens", "3", "--temperature", "0", "--trace"],
        capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr
    match = re.search(r"trace id: ([0-9a-f]{32})", proc.stderr)
    assert match, proc.stderr
    trace_id = match.group(1)

    def both_arrived(_spans):
        names = {s.name for s in receiver.trace(trace_id)}
        return {"mmserve.client.generate", "mmserve.generate", "mmserve.decode"} <= names

    receiver.wait_for(both_arrived, timeout=20)
    spans = receiver.trace(trace_id)
    client = next(s for s in spans if s.name == "mmserve.client.generate")
    root = next(s for s in spans if s.name == "mmserve.generate")
    assert root.parent_span_id == client.span_id


def _scrape(metrics, accept: str | None = None) -> str:
    http, port = start_metrics_server(0, metrics, addr="127.0.0.1")
    try:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": accept} if accept else {})
        return urllib.request.urlopen(request, timeout=10).read().decode()
    finally:
        http.shutdown()


def test_latency_exemplars_name_traces_the_receiver_has(traced, make_video):
    """OpenMetrics exposition: the latency histograms' buckets carry exemplars whose trace_id is the
    trace of a real request, and that trace is in the OTLP receiver (Grafana's jump to Jaeger works)."""
    server, receiver, metrics = traced
    request_id = f"exemplar-{uuid.uuid4().hex[:8]}"
    with Client(f"127.0.0.1:{server.port}", timeout=120) as client:
        client.generate(prompt="What happens?", video=make_video(seed=11, num_frames=4), num_frames=2, max_tokens=3,
                        ignore_eos=True, temperature=0, request_id=request_id)
    root = receiver.wait_for(lambda spans: any(s.attributes.get("mmserve.request.id") == request_id for s in spans))
    trace_id = next(s.trace_id for s in root if s.attributes.get("mmserve.request.id") == request_id)
    text = _scrape(metrics, "application/openmetrics-text; version=1.0.0")
    exemplars = {}
    for family in openmetrics_families(text):
        for sample in family.samples:
            if sample.exemplar is not None:
                exemplars.setdefault(family.name, []).append(sample.exemplar.labels["trace_id"])
    for name in ("mmserve_time_to_first_token_seconds", "mmserve_e2e_request_latency_seconds",
                 "mmserve_request_queue_time_seconds", "mmserve_time_per_output_token_seconds"):
        assert trace_id in exemplars.get(name, []), (name, exemplars.get(name))
    assert "# {trace_id=" not in _scrape(metrics), "the classic text format has no exemplars"


def test_vllm_compatibility_metrics_keep_their_names(traced):
    """The vllm:* set from the real engine, in both formats, with the colon intact in OpenMetrics
    sample lines (prometheus_client alone writes `vllm_...` there: client_python#1177)."""
    server, _, metrics = traced
    ready = server.engine.ready
    for accept in (None, "application/openmetrics-text; version=1.0.0"):
        parse = openmetrics_families if accept else text_string_to_metric_families
        samples = {s.name: s for family in parse(_scrape(metrics, accept)) for s in family.samples}
        running = samples["vllm:num_requests_running"]
        assert running.labels == {"model_name": ready.model_name, "engine": "0"} and running.value == 0
        assert samples["vllm:num_requests_waiting"].value == 0
        info = samples["vllm:cache_config_info"].labels
        assert int(info["block_size"]) == server.engine_config.block_size
        assert int(info["num_gpu_blocks"]) == ready.kv_pool_blocks["full_attention"]
        assert samples["vllm:prefix_cache_queries_total"].value > 0   # the warm-up request at least
        assert "vllm_num_requests_running" not in samples


def test_rpcs_are_counted_by_status_code(traced):
    """`mmserve_rpc_requests_total{rpc, code}` counts calls the edge refused too (INVALID_ARGUMENT)."""
    server, _, metrics = traced

    def counts() -> dict[tuple[str, str], float]:
        return {(s.labels["rpc"], s.labels["code"]): s.value for family in text_string_to_metric_families(_scrape(metrics))
                for s in family.samples if s.name == "mmserve_rpc_requests_total"}

    before = counts()
    with Client(f"127.0.0.1:{server.port}", timeout=60) as client:
        client.generate(prompt="Hi", max_tokens=1)
        with pytest.raises(ClientError) as bad:
            client.generate(prompt="Hi", max_tokens=10**6)
        client.model_info()
    assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
    after = counts()

    def grew(key):
        return after.get(key, 0) - before.get(key, 0)

    assert grew(("Generate", "OK")) == 1 and grew(("Generate", "INVALID_ARGUMENT")) == 1
    assert grew(("GetModelInfo", "OK")) == 1


def test_promql_metric_names_reads_only_metrics():
    expr = ('histogram_quantile(0.99, sum by (le) (rate(a_seconds_bucket{rpc="Generate",code!="OK"}[5m]))) / '
            'ignoring(x) group_left sum(rate(b_total[$__rate_interval])) / scalar(max(c))')
    assert promql_metric_names(expr) == {"a_seconds_bucket", "b_total", "c"}


def test_grafana_dashboard_reads_metrics_a_real_server_exports(traced, make_video):
    """Every metric name in deploy/grafana/mmserve.json's PromQL is in this server's /metrics after a
    video request: the dashboard cannot silently point at renamed or removed metrics."""
    server, _, metrics = traced
    with Client(f"127.0.0.1:{server.port}", timeout=120) as client:
        client.generate(prompt="What happens?", video=make_video(seed=21, num_frames=4), num_frames=2, max_tokens=3,
                        ignore_eos=True, temperature=0)
    exported = {s.name for family in text_string_to_metric_families(_scrape(metrics)) for s in family.samples}
    wanted = dashboard_metric_names()
    assert len(wanted) >= 10
    missing = {name: title for name, title in wanted.items() if name not in exported}
    assert not missing, f"dashboard panels read metrics the server does not export: {missing}"


DOCS_TRACING = Path(__file__).parents[2] / "docs" / "tracing.md"
_DOC_ROW = re.compile(r"^\| `(mmserve\.[a-z_.]+)` \| `([a-z_.]+)` \| (always|admitting|finished|failed) \|")
_DOC_TREE = {"mmserve.video.decode": "mmserve.generate", "mmserve.vision.encode": "mmserve.generate",
             "mmserve.prefill": "mmserve.generate", "mmserve.decode": "mmserve.generate"}


def documented_spans() -> dict[str, dict[str, str]]:
    """docs/tracing.md's span table: span -> {attribute: when present}."""
    table: dict[str, dict[str, str]] = {}
    for line in DOCS_TRACING.read_text().splitlines():
        if match := _DOC_ROW.match(line):
            table.setdefault(match.group(1), {})[match.group(2)] = match.group(3)
    return table


def test_span_tree_and_attributes_equal_the_docs_table(traced, make_video):
    """A video request's spans in the OTLP receiver: the span names, their parents and every
    attribute name equal docs/tracing.md's table (rows `always`/`finished` all present, nothing
    undocumented; `failed` rows only on errors)."""
    server, receiver, _ = traced
    request_id = f"doc-table-{uuid.uuid4().hex[:8]}"
    with Client(f"127.0.0.1:{server.port}", timeout=120) as client:
        client.generate(prompt="What happens?", video=make_video(seed=31, num_frames=4), num_frames=2, max_tokens=3,
                        ignore_eos=True, temperature=0, request_id=request_id)

    def tree(spans):
        roots = [s for s in spans if s.name == "mmserve.generate" and s.attributes.get("mmserve.request.id") == request_id]
        if not roots:
            return None
        children = [s for s in spans if s.parent_span_id == roots[0].span_id]
        steps = [s for s in spans if s.name == "mmserve.engine.step"
                 and (roots[0].trace_id, roots[0].span_id) in s.links]
        return roots[0], children, steps

    spans = receiver.wait_for(lambda s: (t := tree(s)) is not None and any(c.name == "mmserve.decode" for c in t[1]))
    root, children, steps = tree(spans)
    assert steps, "a step span links to the request (step_trace_ratio=1)"
    doc = documented_spans()
    seen: dict[str, set[str]] = {}
    for span in [root, *children, *steps]:
        seen.setdefault(span.name, set()).update(span.attributes)
    assert set(seen) == set(doc), "span names differ from docs/tracing.md"
    assert {c.name: "mmserve.generate" for c in children} == _DOC_TREE
    assert root.parent_span_id == "" and all(s.parent_span_id == "" for s in steps)
    for name, attributes in doc.items():
        expected = {a for a, when in attributes.items() if when != "failed"}
        assert seen[name] == expected, (name, "undocumented:", seen[name] - expected, "missing:", expected - seen[name])
