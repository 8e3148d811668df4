"""Wire the metrics package into a serving process: traces, Prometheus/OTLP metrics, per-request perf.

The front end reports the engine's steps to one observer (from the step records the engine process
sends); this builds that observer from the configs so that `Final.perf` carries each request's
FLOPs/bytes/MFU/MBU and spans reach the configured collector.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from mmserve.config import EngineConfig, ServerConfig
from mmserve.metrics.perf_model import PerfModel
from mmserve.metrics.prometheus import EngineMetrics, start_metrics_server
from mmserve.metrics.telemetry import TelemetryObserver
from mmserve.metrics.tracing import configure_tracing, get_tracer
from mmserve.model.assistant_spec import read_assistant_spec
from mmserve.model.spec import ModelSpec

logger = logging.getLogger(__name__)


@dataclass
class Observability:
    observer: TelemetryObserver
    metrics: EngineMetrics
    tracer_provider: Any = None  # None when tracing is off
    metrics_http: Any = None  # the Prometheus HTTP server, when --metrics-port is set
    metrics_port: int = 0

    def close(self) -> None:
        if self.metrics_http is not None:
            self.metrics_http.shutdown()
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()  # flushes the spans still batched
        self.metrics.shutdown()


def setup_observability(engine_config: EngineConfig, server_config: ServerConfig, *, spec: ModelSpec,
                        configure_global_tracing: bool = True) -> Observability:
    """`spec`: the served model's (read once by the caller: the input processor takes the same)."""
    provider = configure_tracing(server_config.otlp_traces_endpoint or None, set_global=configure_global_tracing)
    # OTLP metrics follow their own variables (OTEL_EXPORTER_OTLP_[METRICS_]ENDPOINT), with tracing on or off
    metrics = EngineMetrics(prometheus=bool(server_config.metrics_port), otlp=True)
    drafter = read_assistant_spec(engine_config.speculative_model) if engine_config.speculative_model else None
    perf = PerfModel(spec, dtype=engine_config.dtype,
                     accounting=engine_config.perf_accounting, tp=engine_config.tensor_parallel_size, drafter=drafter)
    # The peaks arrive from the engine (on_engine_started): they are measured where the model runs.
    observer = TelemetryObserver(perf, tracer=get_tracer(provider), metrics=metrics,
                                 step_trace_ratio=engine_config.step_trace_ratio)
    result = Observability(observer, metrics, provider)
    if server_config.metrics_port:
        result.metrics_http, result.metrics_port = start_metrics_server(server_config.metrics_port, metrics,
                                                                        addr=server_config.host)
    return result
