"""vLLM-named metrics beside ours, for tools that read a vLLM worker's /metrics by name.

Why: the llm-d endpoint picker (and the Gateway API Inference Extension's model-server protocol)
scores replicas from `vllm:num_requests_waiting`, `vllm:num_requests_running`,
`vllm:kv_cache_usage_perc` and `vllm:cache_config_info{block_size,num_gpu_blocks}`; dashboards built
for vLLM read `vllm:prefix_cache_{queries,hits}_total`. The names, types, labels (`model_name`,
`engine`) and meanings are vLLM v1's (`vllm/v1/metrics/loggers.py`):

- running / waiting: requests in the running batch / queued for admission (ours also count requests
  on their way to the engine process, so a burst shows before the next step);
- kv_cache_usage_perc: share of KV blocks in use, 0..1 despite the name; cached blocks nobody holds
  count as free, as in vLLM (our fullest pool, the one that limits admission);
- prefix_cache_queries / hits: counters of tokens looked up in the prefix cache at admission / found
  (new requests only: a preempted request's return is not counted, as vLLM keeps it apart);
- spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens / _num_accepted_tokens_per_pos
  (with `--speculative-model` only, as vLLM has them only with a speculative config): verify chunks
  (one request's drafts scored in one step), draft tokens, accepted drafts, and accepted drafts per
  0-based draft position (`position`, every position from the start);
- cache_config_info: 1, labelled with the cache's block_size, num_gpu_blocks and enable_prefix_caching.

The gauges are read from the engine's load at scrape time, not set per step, so they return to idle
after the last request ends (no step runs then). Prometheus exposition only: OTLP carries ours.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_LABELS = ["model_name", "engine"]
_ENGINE_INDEX = "0"   # one engine core per server; vLLM numbers its data-parallel cores from 0


def capacity_blocks(kv_pool_blocks: dict[str, int]) -> int:
    """The blocks that bound how many tokens stay cached: the full-attention pool's (a sliding pool holds
    only a window per request), else the largest pool."""
    full = [n for name, n in kv_pool_blocks.items() if "full" in name]
    return max(full or kv_pool_blocks.values(), default=0)


class VllmCompatCollector(Collector):
    """Scrape-time view of one engine (an AsyncEngine: `ready` once started, `load()`), and the prefix-cache
    totals `prefix_totals()` returns (queries, hits). Serves nothing until the engine has started."""

    def __init__(self, engine, *, block_size: int, enable_prefix_caching: bool,
                 prefix_totals: Callable[[], tuple[int, int]], speculation=None):
        self.engine = engine
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._prefix_totals = prefix_totals
        self._speculation = speculation   # a prometheus.SpeculationTotals when the engine speculates
        self._last_load = None

    def collect(self) -> Iterator[Metric]:
        ready = getattr(self.engine, "ready", None)
        if ready is None:
            return
        labels = [ready.model_name, _ENGINE_INDEX]
        load = self._read_load()

        def gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, help_text, labels=_LABELS)
            family.add_metric(labels, value)
            return family

        if load is not None:
            yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", load.running)
            yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", load.waiting)
            yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", load.kv_usage)
        cache_info = {"block_size": str(self.block_size), "num_gpu_blocks": str(capacity_blocks(ready.kv_pool_blocks)),
                      "enable_prefix_caching": str(self.enable_prefix_caching), "engine": _ENGINE_INDEX}
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=list(cache_info))
        info.add_metric(list(cache_info.values()), 1)
        yield info
        queries, hits = self._prefix_totals()
        for name, help_text, value in (
                ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", queries),
                ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", hits)):
            counter = CounterMetricFamily(name, help_text, labels=_LABELS)
            counter.add_metric(labels, value)
            yield counter
        spec = self._speculation
        if spec is None:
            return
        for name, help_text, value in (
                ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", spec.drafts),
                ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", spec.draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", spec.accepted_tokens)):
            counter = CounterMetricFamily(name, help_text, labels=_LABELS)
            counter.add_metric(labels, value)
            yield counter
        per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                           "Accepted tokens per draft position.", labels=[*_LABELS, "position"])
        for position, value in enumerate(list(spec.accepted_per_position)):
            per_position.add_metric([*labels, str(position)], value)
        yield per_position

    def _read_load(self):
        """The engine's load. It sums over a dict the event loop mutates, so a read from the scrape
        thread can race it: retry, and keep the last good reading for the rare scrape that loses."""
        for _ in range(5):
            try:
                self._last_load = self.engine.load()
                break
            except RuntimeError:   # "dictionary changed size during iteration"
                continue
        return self._last_load
