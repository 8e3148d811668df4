"""Serving metrics as OpenTelemetry instruments, exported as Prometheus/OpenMetrics text and/or over OTLP.

One set of instruments feeds both exports, so a dashboard and the Kubernetes HPA (which scales on
`mmserve_requests_waiting`) read the very same numbers. Each `EngineMetrics` owns its Prometheus
registry (not prometheus_client's global one), so several engines or tests in one process never
collide. The Prometheus names are listed in `PROMETHEUS_NAMES` and in docs/tracing.md; the latency
histograms carry exemplars (the trace id of a request that landed in the bucket) when they are
recorded with that request's trace context. To add a metric: one instrument in `__init__` and its
Prometheus name in `PROMETHEUS_NAMES` (the tests check both exports serve every name there, and
that every instrument has one).
`watch_engine` adds the vLLM-named compatibility set (`vllm:*`, metrics/vllm_compat.py) that gateways
and endpoint pickers read.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from mmserve.metrics.peaks import DevicePeaks

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                 1.0, 2.5)

# OTel instrument name -> the name Prometheus scrapes (dots become underscores, seconds get the
# `_seconds` unit suffix, counters `_total`).
PROMETHEUS_NAMES = {
    "mmserve.time_to_first_token": "mmserve_time_to_first_token_seconds",
    "mmserve.time_per_output_token": "mmserve_time_per_output_token_seconds",
    "mmserve.e2e_request_latency": "mmserve_e2e_request_latency_seconds",
    "mmserve.request_queue_time": "mmserve_request_queue_time_seconds",
    "mmserve.request_preprocess_time": "mmserve_request_preprocess_time_seconds",
    "mmserve.requests.running": "mmserve_requests_running",
    "mmserve.requests.waiting": "mmserve_requests_waiting",
    "mmserve.kv_cache.usage": "mmserve_kv_cache_usage",
    "mmserve.perf.mfu": "mmserve_perf_mfu",
    "mmserve.perf.mbu": "mmserve_perf_mbu",
    "mmserve.prompt_tokens": "mmserve_prompt_tokens_total",
    "mmserve.multimodal_tokens": "mmserve_multimodal_tokens_total",
    "mmserve.generation_tokens": "mmserve_generation_tokens_total",
    "mmserve.perf.flops": "mmserve_perf_flops_total",
    "mmserve.perf.bytes": "mmserve_perf_bytes_total",
    "mmserve.perf.comm_bytes": "mmserve_perf_comm_bytes_total",
    "mmserve.engine.step_duration": "mmserve_engine_step_duration_seconds_total",
    "mmserve.requests.finished": "mmserve_requests_finished_total",
    "mmserve.prefix_cache.queries": "mmserve_prefix_cache_queries_total",
    "mmserve.prefix_cache.hits": "mmserve_prefix_cache_hits_total",
    "mmserve.prefix_cache.hit_rate": "mmserve_prefix_cache_hit_rate",
    "mmserve.vision.frames_encoded": "mmserve_vision_frames_encoded_total",
    "mmserve.rpc.requests": "mmserve_rpc_requests_total",
    "mmserve.perf.peak_flops": "mmserve_perf_peak_flops",
    "mmserve.perf.peak_bandwidth": "mmserve_perf_peak_bandwidth",
    "mmserve.device_peaks_info": "mmserve_device_peaks_info",
    "mmserve.backend_info": "mmserve_backend_info",
    "mmserve.kv_events.dropped": "mmserve_kv_events_dropped_total",
    "mmserve.encoder_cache.queries": "mmserve_encoder_cache_queries_total",
    "mmserve.encoder_cache.hits": "mmserve_encoder_cache_hits_total",
    "mmserve.live.sessions": "mmserve_live_sessions",
    "mmserve.live.frames_prefilled": "mmserve_live_frames_prefilled_total",
    "mmserve.live.frames_dropped": "mmserve_live_frames_dropped_total",
    "mmserve.live.rollovers": "mmserve_live_rollovers_total",
    "mmserve.live.lag": "mmserve_live_lag_seconds",
    "mmserve.speculative.draft_tokens": "mmserve_speculative_draft_tokens_total",
    "mmserve.speculative.accepted_tokens": "mmserve_speculative_accepted_tokens_total",
    "mmserve.speculative.verify_chunks": "mmserve_speculative_verify_chunks_total",
    "mmserve.tensor_parallel_size": "mmserve_tensor_parallel_size",
}

# Label values known when the metrics are made (or, for draft positions, when speculation is set up):
# their counters are exported at 0 from the start, so a rate() over them is 0, not empty, until the
# first one counts (a drafter that is never right still shows an acceptance of 0).
KV_EVENT_DROP_REASONS = ("publisher_queue_full", "publisher_lagging")
MODALITIES = ("image", "video", "audio")


@dataclass
class StepMetrics:
    """What one engine step contributes: gauges of its state and its work by phase (`prefill` when it
    ran only prompt tokens, `decode` only generated ones, `mixed` both)."""

    running: int
    waiting: int
    kv_usage_by_pool: dict[str, float]
    mfu: float
    mbu: float
    phase: str
    flops: float
    bytes: float
    seconds: float
    comm_bytes: float = 0.0   # sent over the interconnect per GPU (tensor parallelism), not in `bytes`


class SpeculationTotals:
    """Speculative decoding since start, as vLLM counts it (vllm/v1/spec_decode/metrics.py): drafts =
    verify chunks (a request's drafts scored in one step), draft tokens, accepted tokens, and accepted
    tokens per 0-based draft position."""

    def __init__(self) -> None:
        self.drafts = self.draft_tokens = self.accepted_tokens = 0
        self.accepted_per_position: list[int] = []

    def positions(self, n: int) -> None:
        self.accepted_per_position += [0] * (n - len(self.accepted_per_position))

    def add(self, draft_tokens: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += draft_tokens
        self.accepted_tokens += accepted
        self.positions(draft_tokens)
        for position in range(accepted):
            self.accepted_per_position[position] += 1


class EngineMetrics:
    """The engine's instruments. `prometheus=True` exposes them to `start_metrics_server`;
    `otlp_endpoint` (or OTEL_EXPORTER_OTLP_[METRICS_]ENDPOINT with `otlp=True`) exports them over OTLP."""

    def __init__(self, *, prometheus: bool = True, otlp: bool = False, otlp_endpoint: str | None = None,
                 export_interval_s: float = 10.0):
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource

        readers = []
        self.registry = None
        if prometheus:
            from opentelemetry.sdk.metrics.export import InMemoryMetricReader
            from prometheus_client import CollectorRegistry

            from mmserve.metrics.openmetrics import OpenMetricsBridge

            reader = InMemoryMetricReader()
            readers.append(reader)
            self.registry = CollectorRegistry(auto_describe=False)
            self.registry.register(OpenMetricsBridge(reader, PROMETHEUS_NAMES))
        endpoint = otlp_endpoint or (otlp and (os.environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
                                               or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")))
        if endpoint:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

            exporter = OTLPMetricExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
            readers.append(PeriodicExportingMetricReader(exporter, export_interval_millis=export_interval_s * 1e3))
        name = os.environ.get("OTEL_SERVICE_NAME") or "mmserve"
        self.provider = MeterProvider(metric_readers=readers, resource=Resource.create({SERVICE_NAME: name}))
        meter = self.provider.get_meter("mmserve")
        self.ttft = meter.create_histogram("mmserve.time_to_first_token", unit="s",
                                           description="arrival to first generated token",
                                           explicit_bucket_boundaries_advisory=_LATENCY_BUCKETS)
        self.tpot = meter.create_histogram("mmserve.time_per_output_token", unit="s",
                                           description="decode time per generated token after the first",
                                           explicit_bucket_boundaries_advisory=_TPOT_BUCKETS)
        self.e2e = meter.create_histogram("mmserve.e2e_request_latency", unit="s",
                                          description="arrival to the request's end",
                                          explicit_bucket_boundaries_advisory=_LATENCY_BUCKETS)
        self.queue_time = meter.create_histogram("mmserve.request_queue_time", unit="s",
                                                 description="arrival to first schedule (preprocessing included)",
                                                 explicit_bucket_boundaries_advisory=_LATENCY_BUCKETS)
        self.preprocess_time = meter.create_histogram(
            "mmserve.request_preprocess_time", unit="s",
            description="input processing of a request with images or video: decode, resize, patchify, prompt",
            explicit_bucket_boundaries_advisory=_LATENCY_BUCKETS)
        self.running = meter.create_gauge("mmserve.requests.running", description="requests in the running batch")
        self.waiting = meter.create_gauge("mmserve.requests.waiting",
                                          description="requests queued for admission (the HPA scales on this)")
        self.kv_usage = meter.create_gauge("mmserve.kv_cache.usage",
                                           description="share of a KV pool's blocks in use, 0..1, by pool")
        self.mfu = meter.create_gauge("mmserve.perf.mfu", description="last step's model FLOPs utilisation per GPU, 0..1")
        self.mbu = meter.create_gauge("mmserve.perf.mbu", description="last step's memory bandwidth utilisation per GPU, 0..1")
        self.prompt_tokens = meter.create_counter("mmserve.prompt_tokens", description="prompt tokens admitted (frames included)")
        self.mm_tokens = meter.create_counter("mmserve.multimodal_tokens", description="image/frame soft tokens admitted")
        self.generation_tokens = meter.create_counter("mmserve.generation_tokens", description="tokens generated")
        self.flops = meter.create_counter("mmserve.perf.flops", description="estimated model FLOPs per GPU, by step phase")
        self.bytes = meter.create_counter("mmserve.perf.bytes",
                                          description="estimated bytes read and written per GPU, by step phase")
        self.comm_bytes = meter.create_counter(
            "mmserve.perf.comm_bytes",
            description="estimated bytes each GPU sends to the others (tensor parallelism's collectives), by step phase")
        self.step_duration = meter.create_counter("mmserve.engine.step_duration", unit="s",
                                                  description="time spent in engine steps, by step phase")
        self.rpc_requests = meter.create_counter("mmserve.rpc.requests",
                                                 description="RPCs ended, by method and gRPC status code")
        self.finished = meter.create_counter("mmserve.requests.finished", description="requests ended, by finish reason")
        self.prefix_queries = meter.create_counter("mmserve.prefix_cache.queries",
                                                   description="tokens of admitted requests looked up in the prefix cache")
        self.prefix_hits = meter.create_counter("mmserve.prefix_cache.hits",
                                                description="of those, tokens whose KV came from the cache")
        self.prefix_hit_rate = meter.create_gauge("mmserve.prefix_cache.hit_rate",
                                                  description="prefix-cache hits / queries since start, 0..1")
        self.draft_tokens = meter.create_counter(
            "mmserve.speculative.draft_tokens", description="draft tokens verified, by draft position (0-based)")
        self.accepted_tokens = meter.create_counter(
            "mmserve.speculative.accepted_tokens",
            description="of those, drafts the target kept, by position: acceptance rate = accepted / draft tokens")
        self.verify_chunks = meter.create_counter(
            "mmserve.speculative.verify_chunks",
            description="verify chunks run; tokens per chunk = (accepted tokens + verify chunks) / verify chunks")
        self.encoder_cache_queries = meter.create_counter(
            "mmserve.encoder_cache.queries",
            description="images/frames a step computed the K/V of, looked up in the encoder cache, by modality")
        self.encoder_cache_hits = meter.create_counter(
            "mmserve.encoder_cache.hits",
            description="of those, embeddings found there (or earlier in the same step): the vision tower did "
                        "not run on them; misses = queries - hits")
        for modality in MODALITIES:
            self.encoder_cache_queries.add(0, {"modality": modality})
            self.encoder_cache_hits.add(0, {"modality": modality})
        self.frames_encoded = meter.create_counter("mmserve.vision.frames_encoded",
                                                   description="images/frames run through the vision tower "
                                                               "(encoder-cache and prefix-cache hits excluded)")
        self.kv_events_dropped = meter.create_counter(
            "mmserve.kv_events.dropped",
            description="times the ZMQ KV event publisher (--kv-events-config) dropped the batches it held and "
                        "resynced its subscribers from a snapshot, by reason")
        for reason in KV_EVENT_DROP_REASONS:
            self.kv_events_dropped.add(0, {"reason": reason})
        self._prefix_totals = [0, 0]   # queries, hits: the gauge's numerator and denominator
        self.speculation = SpeculationTotals()   # what the vllm:spec_decode_* counters read
        self._pools: set[str] = set()   # KV pools seen, for record_idle
        self._vllm_compat = None        # the watched engine's collector (watch_engine)
        self.peak_flops = meter.create_gauge("mmserve.perf.peak_flops", description="the FLOP/s MFU divides by")
        self.peak_bandwidth = meter.create_gauge("mmserve.perf.peak_bandwidth", description="the bytes/s MBU divides by")
        self.peaks_info = meter.create_gauge("mmserve.device_peaks_info",
                                             description="1, labelled with the MFU/MBU denominators and their source")
        self.backend_info = meter.create_gauge(
            "mmserve.backend_info", description="1 per checked component (layer type, cuda_graphs), labelled with "
                                                "the selected and the running backend and why it fell back")
        self.tensor_parallel_size = meter.create_gauge(
            "mmserve.tensor_parallel_size", description="ranks the decoder is split over; MFU/MBU are per rank")
        # Live video sessions (server/live.py, engine/live_session.py call live_sessions / live_event).
        self.live_sessions_open = meter.create_up_down_counter("mmserve.live.sessions",
                                                               description="live video sessions open")
        self._live_events = {
            "frames_prefilled": meter.create_counter(
                "mmserve.live.frames_prefilled",
                description="live sessions' frames whose K/V reached their context; rate() is frames/s absorbed").add,
            "frames_dropped": meter.create_counter(
                "mmserve.live.frames_dropped",
                description="live frames dropped to keep up (DROP policy; a rebuild's unprefilled frames)").add,
            "rollovers": meter.create_counter("mmserve.live.rollovers",
                                              description="live contexts rebuilt from their newest frames").add,
            "lag_s": meter.create_histogram(
                "mmserve.live.lag", unit="s", explicit_bucket_boundaries_advisory=_LATENCY_BUCKETS,
                description="how long a live session's oldest frame not yet prefilled has waited, at each "
                            "progress report (0 = caught up)").record,
        }
        self.live_sessions_open.add(0)   # exported at 0 from the start, as the counters with known labels
        for what in ("frames_prefilled", "frames_dropped", "rollovers"):
            self._live_events[what](0)

    def watch_engine(self, engine, *, block_size: int, enable_prefix_caching: bool,
                     num_speculative_tokens: int = 0) -> None:
        """Also serve the vLLM-named compatibility set (metrics/vllm_compat.py) of `engine`, an AsyncEngine,
        read at scrape time. Prometheus exposition only; a no-op without it. `num_speculative_tokens`:
        the draft positions when the engine speculates (0: it does not); their counters start at 0."""
        from mmserve.metrics.vllm_compat import VllmCompatCollector

        if num_speculative_tokens:
            self.speculates(num_speculative_tokens)
        if self.registry is None:
            return
        if self._vllm_compat is not None:   # a server restarted on these metrics: one engine's set, not two
            self.registry.unregister(self._vllm_compat)
        self._vllm_compat = VllmCompatCollector(engine, block_size=block_size,
                                                enable_prefix_caching=enable_prefix_caching,
                                                prefix_totals=lambda: tuple(self._prefix_totals),
                                                speculation=self.speculation if num_speculative_tokens else None)
        self.registry.register(self._vllm_compat)

    def speculates(self, num_tokens: int) -> None:
        """The engine drafts up to `num_tokens` per step: every position's counters exist from now on."""
        self.verify_chunks.add(0)
        for position in range(num_tokens):
            self.draft_tokens.add(0, {"position": str(position)})
            self.accepted_tokens.add(0, {"position": str(position)})
        self.speculation.positions(num_tokens)

    def count_kv_events_dropped(self, reason: str) -> None:
        self.kv_events_dropped.add(1, {"reason": reason})

    def live_sessions(self, delta: int) -> None:
        """A live session opened (+1) or ended (-1)."""
        self.live_sessions_open.add(delta)

    def live_event(self, what: str, value: float) -> None:
        """A live session's progress: `what` is frames_prefilled, frames_dropped or rollovers (counts),
        or lag_s (seconds, at each progress report)."""
        self._live_events[what](value)

    def count_rpc(self, rpc: str, code: str) -> None:
        self.rpc_requests.add(1, {"rpc": rpc, "code": code})

    def set_peaks(self, peaks: DevicePeaks) -> None:
        self.peak_flops.set(peaks.flops)
        self.peak_bandwidth.set(peaks.bandwidth)
        self.peaks_info.set(1, {"device": peaks.name, "dtype": peaks.dtype, "source": peaks.source,
                                "peak_flops": f"{peaks.flops:.6g}", "peak_bandwidth": f"{peaks.bandwidth:.6g}"})

    def set_parallel_layout(self, tensor_parallel_size: int) -> None:
        self.tensor_parallel_size.set(tensor_parallel_size)

    def set_backend_checks(self, checks) -> None:
        for c in checks:
            self.backend_info.set(1, {"component": c.component, "selected": c.selected, "running": c.running,
                                      "fallback_reason": c.reason[:200]})

    def record_step(self, step: StepMetrics) -> None:
        self.running.set(step.running)
        self.waiting.set(step.waiting)
        for pool, usage in step.kv_usage_by_pool.items():
            self.kv_usage.set(usage, {"pool": pool})
            self._pools.add(pool)
        self.mfu.set(step.mfu)
        self.mbu.set(step.mbu)
        phase = {"phase": step.phase}
        self.flops.add(step.flops, phase)
        self.bytes.add(step.bytes, phase)
        self.comm_bytes.add(step.comm_bytes, phase)
        self.step_duration.add(step.seconds, phase)

    def record_speculation(self, items) -> None:
        """One step's verify chunks: each scored `draft_tokens` drafts and kept the first `accepted_drafts`."""
        for item in items:
            if item.draft_tokens:
                self.verify_chunks.add(1)
                self.speculation.add(item.draft_tokens, item.accepted_drafts)
                for position in range(item.draft_tokens):
                    self.draft_tokens.add(1, {"position": str(position)})
                    if position < item.accepted_drafts:
                        self.accepted_tokens.add(1, {"position": str(position)})

    def record_encoder_cache(self, modality: str, queries: int, hits: int) -> None:
        if queries:
            self.encoder_cache_queries.add(queries, {"modality": modality})
            self.encoder_cache_hits.add(hits, {"modality": modality})

    def record_idle(self) -> None:
        """The last request in flight ended: no step follows to update the gauges, so set them to what
        an idle engine has (nothing running or waiting, no KV block held; cached ones count as free)."""
        self.running.set(0)
        self.waiting.set(0)
        for pool in self._pools:
            self.kv_usage.set(0.0, {"pool": pool})

    def record_prefix_cache(self, queries: int, hits: int) -> None:
        """One step's prefix-cache lookups (tokens), at the admission of each request."""
        if queries:
            self.prefix_queries.add(queries)
            self.prefix_hits.add(hits)
            self._prefix_totals[0] += queries
            self._prefix_totals[1] += hits
            self.prefix_hit_rate.set(self._prefix_totals[1] / self._prefix_totals[0])

    def shutdown(self) -> None:
        self.provider.shutdown()


def start_metrics_server(port: int, metrics: EngineMetrics, addr: str = "0.0.0.0"):
    """Serve `metrics` as Prometheus text (or OpenMetrics, with exemplars, when the scraper asks) at
    http://addr:port/metrics (port 0 = a free port), from a daemon thread. Returns (server, port);
    `server.shutdown()` stops it."""
    import gzip
    import socket
    import threading
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client.exposition import ThreadingWSGIServer, gzip_accepted

    from mmserve.metrics.openmetrics import exposition

    if metrics.registry is None:
        raise ValueError("EngineMetrics was built with prometheus=False")
    registry = metrics.registry

    def app(environ, start_response):
        body, content_type = exposition(registry, environ.get("HTTP_ACCEPT", ""))
        headers = [("Content-Type", content_type)]
        if gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING", "")):
            body = gzip.compress(body)
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", headers)
        return [body]

    class QuietHandler(WSGIRequestHandler):
        def log_message(self, format, *args):   # a scrape every few seconds is not news
            pass

    class MetricsHTTPServer(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in addr else socket.AF_INET

        def shutdown(self) -> None:   # stop serving and release the port
            super().shutdown()
            self.server_close()

    server = make_server(addr, port, app, server_class=MetricsHTTPServer, handler_class=QuietHandler)
    threading.Thread(target=server.serve_forever, name="mmserve-metrics-http", daemon=True).start()
    bound = server.server_address[1]
    logger.info("Prometheus metrics on http://%s:%d/metrics", addr, bound)
    return server, bound

