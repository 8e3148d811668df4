"""One call that turns the serving configs into running telemetry: tracing, metrics, the observer.

The server owns when it runs; this module owns what runs:

    telemetry = start_telemetry(engine_config, server_config)
    engine = AsyncEngine(engine_config, observer=telemetry.observer)
    ...
    telemetry.shutdown()   # after the engine stopped: flushes spans and metrics
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from mmserve.config import EngineConfig, ServerConfig
from mmserve.metrics.model_spec import model_shape
from mmserve.metrics.peaks import detect
from mmserve.metrics.perf_model import PerfModel
from mmserve.metrics.prometheus import EngineMetrics, start_metrics_server
from mmserve.metrics.telemetry import TelemetryObserver
from mmserve.metrics.tracing import configure_tracing, get_tracer

logger = logging.getLogger(__name__)


@dataclass
class Telemetry:
    observer: TelemetryObserver
    metrics: EngineMetrics
    tracer_provider: Any = None     # None when tracing is off
    metrics_server: Any = None      # the Prometheus HTTP server, None when --metrics-port is 0
    metrics_port: int = 0

    def shutdown(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
        self.metrics.shutdown()
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()


def start_telemetry(engine_config: EngineConfig, server_config: ServerConfig, *, set_global: bool = True) -> Telemetry:
    """Tracing from --otlp-traces-endpoint / OTEL_* env, metrics on --metrics-port (and over OTLP when
    OTEL_EXPORTER_OTLP_[METRICS_]ENDPOINT is set), and the observer pricing steps for the served model."""
    provider = configure_tracing(server_config.otlp_traces_endpoint or None, set_global=set_global)
    metrics = EngineMetrics(prometheus=server_config.metrics_port > 0, otlp=True)
    server, port = (start_metrics_server(server_config.metrics_port, metrics, addr=server_config.host)
                    if server_config.metrics_port > 0 else (None, 0))
    perf = PerfModel(model_shape(engine_config.model), dtype=engine_config.dtype,
                     accounting=engine_config.perf_accounting)
    peaks = detect(engine_config.device, engine_config.dtype)
    logger.info("MFU/MBU denominators for %s: %.4g FLOP/s, %.4g B/s (%s)", peaks.name, peaks.flops, peaks.bandwidth,
                peaks.source)
    observer = TelemetryObserver(perf, peaks, tracer=get_tracer(provider), metrics=metrics,
                                 step_trace_ratio=engine_config.step_trace_ratio)
    return Telemetry(observer, metrics, provider, server, port)
