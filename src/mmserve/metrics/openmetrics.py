"""Prometheus / OpenMetrics exposition of the OTel instruments, exemplars included.

Why our own bridge: opentelemetry-exporter-prometheus drops exemplars, and an operator wants to jump
from a latency bucket to a trace that landed in it (Grafana reads OpenMetrics exemplars). The SDK
records an exemplar (trace id, span id, value) when a histogram is recorded inside a sampled span's
context and hands it over once; this collector keeps the latest one per bucket, so every scrape
shows one. Names are the explicit `PROMETHEUS_NAMES` of `metrics/prometheus.py`, not derived.
Exemplars appear only in the OpenMetrics format (`Accept: application/openmetrics-text`, what
Prometheus asks for with exemplar storage on); the classic text format omits them. `exposition`
picks the format from the scraper's Accept header (and works around a prometheus_client bug there).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from itertools import accumulate

from opentelemetry.sdk.metrics.export import Gauge, Histogram, InMemoryMetricReader, Sum
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics import exposition as openmetrics_text
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar


class OpenMetricsBridge(Collector):
    """A prometheus_client collector over an OTel pull reader (cumulative temporality)."""

    def __init__(self, reader: InMemoryMetricReader, names: Mapping[str, str]):
        self.reader = reader
        self.names = names
        self._exemplars: dict[tuple, Exemplar] = {}   # (metric, labels, bucket index) -> the latest one

    def collect(self) -> Iterator[Metric]:
        data = self.reader.get_metrics_data()
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    family = self._family(metric)
                    if family is not None:
                        yield family

    def _family(self, metric) -> Metric | None:
        name = self.names.get(metric.name, metric.name.replace(".", "_"))
        points = list(metric.data.data_points)
        keys = sorted({k for p in points for k in (p.attributes or {})})

        def labels(point) -> list[str]:
            return [str((point.attributes or {}).get(k, "")) for k in keys]

        if isinstance(metric.data, Histogram):
            family = HistogramMetricFamily(name, metric.description, labels=keys)
            for p in points:
                family.add_metric(labels(p), self._buckets(metric.name, labels(p), p), p.sum)
            return family
        if isinstance(metric.data, Sum) and metric.data.is_monotonic:
            family = CounterMetricFamily(name, metric.description, labels=keys)
        elif isinstance(metric.data, Sum | Gauge):
            family = GaugeMetricFamily(name, metric.description, labels=keys)
        else:
            return None
        for p in points:
            family.add_metric(labels(p), p.value)
        return family

    def _buckets(self, metric: str, label_values: list[str], point) -> list[tuple]:
        bounds = list(point.explicit_bounds)
        for e in point.exemplars:
            index = next((i for i, bound in enumerate(bounds) if e.value <= bound), len(bounds))
            if e.trace_id:
                self._exemplars[(metric, tuple(label_values), index)] = Exemplar(
                    {"trace_id": f"{e.trace_id:032x}", "span_id": f"{e.span_id:016x}"}, e.value,
                    e.time_unix_nano / 1e9)
        buckets = []
        for i, (le, count) in enumerate(zip([*map(repr, map(float, bounds)), "+Inf"],
                                            accumulate(point.bucket_counts), strict=True)):
            exemplar = self._exemplars.get((metric, tuple(label_values), i))
            buckets.append((le, count, exemplar) if exemplar else (le, count))
        return buckets


def exposition(registry: CollectorRegistry, accept: str) -> tuple[bytes, str]:
    """(body, content type) of a scrape, in the format the Accept header asks for.

    prometheus_client (0.26, client_python#1177) writes OpenMetrics sample names with label-name
    escaping, so `vllm:num_requests_running` goes out as `vllm_num_requests_running` under its TYPE
    line and Prometheus stores the wrong name. Every name served here is a valid classic name, and for
    those the `allow-utf-8` writer's output is exactly the correct OpenMetrics 1.0 text: use it."""
    encoder, content_type = choose_encoder(accept)
    if content_type.startswith("application/openmetrics-text"):
        return (openmetrics_text.generate_latest(registry, escaping=openmetrics_text.ALLOWUTF8),
                openmetrics_text.CONTENT_TYPE_LATEST)
    return encoder(registry), content_type
