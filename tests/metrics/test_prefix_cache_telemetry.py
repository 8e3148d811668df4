"""What users and operators see of the prefix cache, on a real server with the TelemetryObserver:
a follow-up question about the same video reports its cached tokens in Final.usage (through the
Python client), its admitting prefill span carries them, no vision span appears, its perf bills only
the tokens computed, the Prometheus counters and hit-rate gauge add up, and GetServerLoad reports
the cached blocks apart from the blocks in use."""

from __future__ import annotations

import random
import urllib.request
import uuid

import pytest
from loopback_server import LoopbackServer, engine_config
from otlp_receiver import global_traces_to

from mmserve.clients import Client
from mmserve.config import ServerConfig
from mmserve.metrics.peaks import DevicePeaks
from mmserve.metrics.perf_model import PerfModel, RequestWork, StepContext
from mmserve.metrics.prometheus import EngineMetrics, start_metrics_server
from mmserve.metrics.telemetry import TelemetryObserver
from mmserve.metrics.tracing import get_tracer
from mmserve.model.spec import load_spec

PEAKS = DevicePeaks("test", flops=1e10, bandwidth=1e10, source="test")


@pytest.fixture(scope="module")
def served(served_model):
    from otlp_receiver import OtlpReceiver

    receiver = OtlpReceiver()
    with global_traces_to(receiver):
        metrics = EngineMetrics(prometheus=True)
        # upper-bound attention accounting: what the chunk after the hit costs does not depend on
        # where its frames lie, which this test (a client) does not know
        perf = PerfModel(load_spec(served_model), dtype="float32", accounting="upper-bound")
        observer = TelemetryObserver(perf, PEAKS, tracer=get_tracer(), metrics=metrics, step_trace_ratio=0)
        server = LoopbackServer(engine_config(served_model, default_num_frames=2),
                                ServerConfig(port=0, worker_threads=2, drain_grace_s=5.0), observer=observer).start()
        http, port = start_metrics_server(0, metrics, addr="127.0.0.1")
        try:
            yield server, receiver, perf, port
        finally:
            http.shutdown()
            server.stop()
            metrics.shutdown()
    receiver.stop()


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {line.split("{")[0].split(" ")[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_a_follow_up_question_is_served_from_the_cache_and_billed_for_what_it_computed(served, make_video):
    server, receiver, perf, port = served
    video = make_video(seed=random.randrange(1000), num_frames=4)
    before = scrape(port)
    results, ids = [], []
    with Client(f"127.0.0.1:{server.port}", timeout=120) as client:
        for question in ("Question: what moves here?", "Question: which colour is it?"):
            ids.append(f"prefix-{uuid.uuid4().hex[:8]}")
            results.append(client.generate(prompt=question, video=video, num_frames=2, max_tokens=3,
                                           ignore_eos=True, temperature=0, request_id=ids[-1]))
        load = client.server_load()
    first, second = results
    assert first.usage.cached_tokens == 0
    # Whole 16-token blocks, cut back to the start of a frame the block boundary would split.
    assert second.usage.cached_tokens > 0 and second.usage.cached_tokens % 16 == 0
    assert load.kv_cache_usage == 0 and load.kv_cache_cached_usage > 0

    def children(spans, rid):
        root = next((s for s in spans if s.name == "mmserve.generate" and s.attributes.get("mmserve.request.id") == rid),
                    None)
        return [s for s in spans if root is not None and s.parent_span_id == root.span_id]

    spans = receiver.wait_for(lambda s: all(any(c.name == "mmserve.decode" for c in children(s, r)) for r in ids))
    prefills = [s for s in children(spans, ids[1]) if s.name == "mmserve.prefill"]
    # One chunk after the hit; frames it recomputes come from the encoder cache: no vision span.
    assert len(prefills) == 1 and "mmserve.vision.encode" not in {s.name for s in children(spans, ids[1])}
    attrs = prefills[0].attributes
    assert attrs["mmserve.prefill.cached_tokens"] == second.usage.cached_tokens
    assert attrs["mmserve.prefill.num_tokens"] == second.usage.prompt_tokens - second.usage.cached_tokens

    # The perf model billed the computed chunk (and the decode steps), not the cached prefix.
    prompt, cached = second.usage.prompt_tokens, second.usage.cached_tokens
    steps = [RequestWork(prompt - cached, prompt, True)] + [
        RequestWork(1, prompt + k, False) for k in (1, 2)]
    billed = sum(perf.step(StepContext((w,)), per_gpu=True).total_flops for w in steps)
    assert second.perf.flops == pytest.approx(billed, rel=1e-6)
    uncached = perf.step(StepContext((RequestWork(prompt, prompt, True),)), per_gpu=True).total_flops
    assert second.perf.flops < uncached < first.perf.flops        # the first also paid for vision

    after = scrape(port)

    def delta(name):
        return after[name] - before.get(name, 0.0)

    assert delta("mmserve_prefix_cache_queries_total") == first.usage.prompt_tokens + prompt
    assert delta("mmserve_prefix_cache_hits_total") == cached
    assert after["mmserve_prefix_cache_hit_rate"] == pytest.approx(
        after["mmserve_prefix_cache_hits_total"] / after["mmserve_prefix_cache_queries_total"])
    assert delta("mmserve_vision_frames_encoded_total") == 2
