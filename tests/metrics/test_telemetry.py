"""TelemetryObserver on a synthetic step sequence, exporting over real OTLP/gRPC to a loopback
receiver: the request's span tree under the client's traceparent, perf attributes that add up,
sampled engine-step spans with links, a cancelled request marked as an error, and the Prometheus
endpoint serving every metric."""

from __future__ import annotations

import random
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from mmserve.config import EngineConfig, ServerConfig
from mmserve.engine.observer import EngineObserver, NullObserver
from mmserve.errors import RequestAbortedError
from mmserve.ipc.records import ScheduledItem, StepRecord
from mmserve.metrics.attention_pairs import kept_pairs
from mmserve.metrics.peaks import DevicePeaks
from mmserve.metrics.perf_model import PerfBreakdown, PerfModel, RequestWork, StepContext, VisionWork
from mmserve.metrics.prometheus import PROMETHEUS_NAMES, EngineMetrics, start_metrics_server
from mmserve.metrics.telemetry import TelemetryObserver
from mmserve.metrics.tracing import (
    configure_tracing,
    end_request_span,
    get_tracer,
    inject_trace_context,
    set_request_attributes,
    start_request_span,
)
from mmserve.model.spec import load_spec
from mmserve.request import MultiModalInput, Request
from mmserve.sampling_params import SamplingParams
from mmserve.server.observability import setup_observability
from mmserve.worker.backend_check import BackendCheck

CONFIG = dict(
    model_type="gemma4",
    text_config=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                     num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
                     layer_types=(["sliding_attention"] * 2 + ["full_attention"]) * 2,
                     use_bidirectional_attention="vision", hidden_size_per_layer_input=0),
    vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2),
)
PEAKS = DevicePeaks("test", flops=1e9, bandwidth=1e9, source="test")


class StepClock:
    """Builds StepRecords with consistent perf_counter / epoch-ns clocks."""

    def __init__(self):
        self.index = 0

    def step(self, items, *, running=1, waiting=0, kv=0.1) -> StepRecord:
        start_perf, start_ns = time.perf_counter(), time.time_ns()
        duration = random.uniform(0.001, 0.01)
        self.index += 1
        return StepRecord(self.index - 1, start_perf, start_perf + duration, start_ns, start_ns + int(duration * 1e9),
                          items, running, waiting, kv, kv_usage_by_pool={"sliding_attention": kv / 2, "full_attention": kv})


def frame_input(patches: int) -> MultiModalInput:
    return MultiModalInput(torch.rand(patches, 48), torch.zeros(patches, 2, dtype=torch.long))


@pytest.fixture
def tracing(otlp_receiver):
    provider = configure_tracing(otlp_receiver.endpoint, service_name="mmserve-test", set_global=False)
    yield provider, otlp_receiver
    provider.shutdown()


def test_observer_builds_the_request_span_tree(tracing):
    provider, receiver = tracing
    tracer = get_tracer(provider)
    perf = PerfModel(load_spec(CONFIG), dtype="float32")
    observer = TelemetryObserver(perf, PEAKS, tracer=tracer, step_trace_ratio=1.0)

    # The client's span, propagated as gRPC metadata the way the client library does it.
    client = TracerProvider().get_tracer("client").start_span("client.call")
    metadata = inject_trace_context([("x-api-key", "k")], trace.set_span_in_context(client))
    assert any(k == "traceparent" for k, _ in metadata)

    # Request A: two frames of 4 soft tokens each at [3, 6] and [9, 12], prompt of 16 tokens.
    patches = random.choice([16, 20])
    a_span, a_ctx = start_request_span(metadata, request_id="a", model="demo", tracer=tracer)
    a = Request("a", list(range(16)), SamplingParams(max_tokens=3), mm_ranges=[(3, 6), (9, 12)],
                mm_inputs=[frame_input(patches), frame_input(patches)], trace_context=a_ctx)
    b_span, b_ctx = start_request_span([], request_id="b", model="demo", tracer=tracer)
    b = Request("b", list(range(5)), SamplingParams(max_tokens=8), trace_context=b_ctx)
    observer.on_request_queued(a)
    observer.on_request_queued(b)

    clock = StepClock()
    steps = [
        clock.step([ScheduledItem("a", 8, 8, True, 1, request=a), ScheduledItem("b", 5, 5, True, 0, request=b)], running=2, waiting=0),
        clock.step([ScheduledItem("a", 8, 16, True, 1, request=a), ScheduledItem("b", 1, 6, False, 0, request=b)], running=2),
        clock.step([ScheduledItem("a", 1, 17, False, 0, request=a), ScheduledItem("b", 1, 7, False, 0, request=b)], running=2),
        clock.step([ScheduledItem("a", 1, 18, False, 0, request=a)], running=1),
    ]
    observer.on_step(steps[0])
    observer.on_first_token(b)
    b.output_token_ids.append(1)
    observer.on_step(steps[1])
    observer.on_first_token(a)
    a.output_token_ids.append(1)
    b.output_token_ids.append(1)
    observer.on_step(steps[2])
    a.output_token_ids.append(1)
    observer.on_request_finished(b, None, RequestAbortedError("b was aborted"))
    end_request_span(b_span, cancelled=True)
    observer.on_step(steps[3])
    a.output_token_ids.append(1)
    observer.on_request_finished(a, "length", None)
    set_request_attributes(a_span, max_tokens=3, temperature=0.0, input_tokens=16, output_tokens=3,
                           finish_reasons=["length"], time_in_queue=0.001, time_to_first_token=0.02,
                           num_frames=2, num_mm_tokens=8, perf=a.perf)
    end_request_span(a_span)
    provider.force_flush()

    spans = receiver.wait_for(lambda s: sum(x.name == "mmserve.generate" for x in s) == 2)
    by_name = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    gen_a = next(s for s in by_name["mmserve.generate"] if s.attributes["mmserve.request.id"] == "a")
    gen_b = next(s for s in by_name["mmserve.generate"] if s.attributes["mmserve.request.id"] == "b")
    client_ctx = client.get_span_context()
    assert gen_a.trace_id == format(client_ctx.trace_id, "032x")
    assert gen_a.parent_span_id == format(client_ctx.span_id, "016x")
    assert gen_a.resource["service.name"] == "mmserve-test"
    assert gen_a.attributes["gen_ai.usage.output_tokens"] == 3
    assert gen_a.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert gen_a.attributes["gen_ai.operation.name"] == "generate_content"
    assert not gen_a.is_error and gen_b.is_error

    children_a = [s for s in spans if s.parent_span_id == gen_a.span_id]
    assert sorted(s.name for s in children_a) == sorted(
        ["mmserve.vision.encode"] * 2 + ["mmserve.prefill"] * 2 + ["mmserve.decode"])
    prefill = sorted((s for s in children_a if s.name == "mmserve.prefill"),
                     key=lambda s: s.attributes["mmserve.prefill.chunk_index"])
    assert [s.attributes["mmserve.prefill.context_len"] for s in prefill] == [8, 16]
    keys = {"mmserve.perf.flops", "mmserve.perf.read_bytes", "mmserve.perf.write_bytes", "mmserve.perf.mfu",
            "mmserve.perf.mbu", "mmserve.perf.attn_flops.sliding", "mmserve.perf.attn_flops.full"}
    for s in children_a:
        assert keys <= s.attributes.keys(), s.name

    # The first prefill chunk: A's token share (8 of 13) of the text work of step 0, priced independently.
    def text_step(works):
        return perf.step(StepContext(tuple(works)), per_gpu=True)

    step0_text = text_step([RequestWork(8, 8, True, ((3, 6), (9, 12)), samples=False), RequestWork(5, 5, True)])
    assert prefill[0].attributes["mmserve.perf.flops"] == pytest.approx(step0_text.total_flops * 8 / 13)
    assert prefill[0].attributes["mmserve.perf.attn_flops.sliding"] == pytest.approx(step0_text.attn_flops_sliding * 8 / 13)
    # Each step encodes one frame of `patches` rows (a multiple of the 2x2 pooling window): executed
    # work is the frame as run (its rows, rows / 4 pooled slots); useful work its 4 soft tokens.
    frame = perf.step(StepContext(images=(VisionWork(patches, patches // 4),)), per_gpu=True)
    useful = perf.step(StepContext(images=(VisionWork(patches, 4),)), per_gpu=True)
    step0_total = step0_text.total_flops + frame.total_flops
    assert prefill[0].attributes["mmserve.perf.mfu"] == pytest.approx(step0_total / (steps[0].duration_s * PEAKS.flops))
    vision = [s for s in children_a if s.name == "mmserve.vision.encode"]
    assert all(s.attributes["mmserve.perf.flops"] == pytest.approx(frame.total_flops) for s in vision)
    assert all(s.attributes["mmserve.vision.useful_flops"] == pytest.approx(useful.total_flops) for s in vision)
    assert all(s.attributes["mmserve.vision.padded_patches"] == patches for s in vision)

    # The request's perf is the sum of its spans' work.
    assert sum(s.attributes["mmserve.perf.flops"] for s in children_a) == pytest.approx(a.perf["flops"])
    assert set(a.perf) == {"flops", "read_bytes", "write_bytes", "mfu", "mbu", "attn_flops_sliding", "attn_flops_full"}
    assert gen_a.attributes["mmserve.perf.flops"] == pytest.approx(a.perf["flops"])

    # B was cancelled while decoding: its decode span is an error too.
    decode_b = next(s for s in spans if s.parent_span_id == gen_b.span_id and s.name == "mmserve.decode")
    assert decode_b.is_error

    # Every step was sampled (ratio 1.0); each links to the generate spans of its batch.
    step_spans = sorted(by_name["mmserve.engine.step"], key=lambda s: s.attributes["mmserve.step.index"])
    assert len(step_spans) == 4
    assert {sid for _, sid in step_spans[0].links} == {gen_a.span_id, gen_b.span_id}
    assert step_spans[3].links == [(gen_a.trace_id, gen_a.span_id)]
    assert step_spans[0].attributes["mmserve.step.frames_encoded"] == 1
    # Kept pairs of step 0 (window 8): B's 5 causal queries keep 1+...+5 = 15; A's 8 keep 1+...+8 = 36 and,
    # on sliding layers (bidirectional for frames), frame [3, 6] adds its future keys 3+2+1 (frame [9, 12]
    # is not in this chunk).
    assert step_spans[0].attributes["mmserve.attention.kept_pairs.sliding"] == 15 + 36 + 6
    assert step_spans[0].attributes["mmserve.attention.kept_pairs.full"] == 15 + 36


def test_kv_sharing_layers_do_not_set_the_kept_pairs():
    """E4B's KV-sharing layers (the last group) run only the sampling rows; the step span's kept pairs
    are one ordinary layer's, not theirs (their one sampling row's: ~100x low on a prefill chunk)."""
    spec = load_spec(Path(__file__).parents[1] / "fixtures" / "gemma4_family" / "e4b.json")
    assert any(layer.shares_kv for layer in spec.layers)
    window = spec.attention_specs["sliding_attention"].window
    num_tokens = random.randint(window // 4, window)
    context_len = num_tokens + random.randint(window, 4 * window)
    step = PerfModel(spec).step(StepContext(requests=(RequestWork(num_tokens, context_len, True),)))
    assert step.kept_pairs_sliding == kept_pairs(num_tokens, context_len, window)
    assert step.kept_pairs_full == kept_pairs(num_tokens, context_len, None)


def test_step_spans_are_sampled(tracing):
    provider, receiver = tracing
    observer = TelemetryObserver(PerfModel(load_spec(CONFIG)), PEAKS, tracer=get_tracer(provider),
                                 step_trace_ratio=0.25)
    r = Request("r", list(range(4)), SamplingParams())
    observer.on_request_queued(r)
    clock = StepClock()
    for i in range(12):
        observer.on_step(clock.step([ScheduledItem("r", 1, 5 + i, False, 0, request=r)]))
    observer.on_request_finished(r, "length", None)
    provider.force_flush()
    receiver.wait_for(lambda s: len(s) >= 3)
    time.sleep(0.2)
    assert sorted(s.attributes["mmserve.step.index"] for s in receiver.spans) == [0, 4, 8]


def test_the_observers_define_every_hook_of_the_protocol():
    """The front end calls hooks by name (OutputProcessor._notify logs a failure and goes on), so a
    hook renamed on one side only would go quiet: the default and the telemetry observer define every
    hook EngineObserver names, and no other."""
    hooks = {name for name in vars(EngineObserver) if name.startswith("on_")}
    assert {name for name in vars(NullObserver) if name.startswith("on_")} == hooks
    assert {name for name in vars(TelemetryObserver) if name.startswith("on_")} == hooks


def test_prometheus_endpoint_serves_the_metrics(otlp_receiver):
    metrics = EngineMetrics(prometheus=True, otlp_endpoint=otlp_receiver.endpoint, export_interval_s=60)
    observer = TelemetryObserver(PerfModel(load_spec(CONFIG)), metrics=metrics, step_trace_ratio=0)
    observer.on_engine_started(PEAKS)
    observer.on_backends_checked((BackendCheck("full_attention", "flex", "sdpa", "forced"),))
    r = Request("r", list(range(6)), SamplingParams(), mm_ranges=[(1, 4)], preprocess_s=0.25)
    queued = Request("queued", list(range(3)), SamplingParams())   # still waiting when r ends; no media
    observer.on_request_queued(r)
    observer.on_request_queued(queued)
    clock = StepClock()
    waiting = random.randint(1, 50)
    observer.on_step(clock.step([ScheduledItem("r", 6, 6, True, 1, request=r, prefix_queried=6)], waiting=waiting, kv=0.5))
    observer.on_first_token(r)
    r.output_token_ids += [1, 2]
    observer.on_step(clock.step([ScheduledItem("r", 1, 7, False, 0, request=r)], waiting=waiting, kv=0.5))
    observer.on_request_finished(r, "length", None)
    metrics.rpc_requests.add(1, {"rpc": "Generate", "code": "OK"})  # the server's interceptor counts RPCs
    metrics.live_sessions(1)   # a live session's hooks (server/live.py, engine/live_session.py)
    for what, value in (("frames_prefilled", 3), ("frames_dropped", 1), ("rollovers", 1), ("lag_s", 0.2)):
        metrics.live_event(what, value)
    metrics.speculates(2)   # --speculative-model's counters (from the start, at 0)
    tensor_parallel_size = random.choice((1, 2, 4, 8))
    metrics.set_parallel_layout(tensor_parallel_size)

    server, port = start_metrics_server(0, metrics, addr="127.0.0.1")

    def scrape() -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        return {line.split("{")[0].split(" ")[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line and not line.startswith("#")}

    try:
        samples = scrape()
        # The last request in flight ends: no step follows, yet the gauges must read idle (the HPA and the
        # dashboard would otherwise see the last step's load forever).
        observer.on_request_finished(queued, None, RequestAbortedError("queued was aborted"))
        idle = scrape()
    finally:
        server.shutdown()
    assert (idle["mmserve_requests_running"], idle["mmserve_requests_waiting"], idle["mmserve_kv_cache_usage"]) == (0, 0, 0)
    for name in PROMETHEUS_NAMES.values():
        assert name in samples or f"{name}_count" in samples, name
    assert samples["mmserve_requests_waiting"] == waiting
    assert (samples["mmserve_request_preprocess_time_seconds_count"],
            samples["mmserve_request_preprocess_time_seconds_sum"]) == (1, 0.25)   # r's only: `queued` has no media
    assert samples["mmserve_kv_cache_usage"] in (0.25, 0.5)  # one sample per pool (the last one wins here)
    assert samples["mmserve_prompt_tokens_total"] == 6
    assert samples["mmserve_multimodal_tokens_total"] == 4
    assert samples["mmserve_generation_tokens_total"] == 2
    assert samples["mmserve_time_per_output_token_seconds_count"] == 1
    assert samples["mmserve_perf_flops_total"] > 0 and samples["mmserve_perf_bytes_total"] > 0
    assert samples["mmserve_engine_step_duration_seconds_total"] > 0
    assert (samples["mmserve_live_sessions"], samples["mmserve_live_frames_prefilled_total"],
            samples["mmserve_live_lag_seconds_count"]) == (1, 3, 1)
    assert samples["mmserve_tensor_parallel_size"] == tensor_parallel_size

    metrics.provider.force_flush()
    with otlp_receiver.cond:
        otlp_receiver.cond.wait_for(lambda: "mmserve.requests.waiting" in otlp_receiver.metric_names, timeout=10)
    # every instrument has its explicit Prometheus name (one missing here is served by a guessed one)
    assert otlp_receiver.metric_names == set(PROMETHEUS_NAMES)
    metrics.shutdown()


def test_otlp_metrics_endpoint_alone_exports_the_metrics(otlp_receiver, monkeypatch):
    """OTEL_EXPORTER_OTLP_METRICS_ENDPOINT alone turns the OTLP metrics on (docs/tracing.md): they were
    exported only when tracing was configured too."""
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", otlp_receiver.endpoint)
    observability = setup_observability(EngineConfig(device="cpu"), ServerConfig(port=0), spec=load_spec(CONFIG),
                                        configure_global_tracing=False)
    try:
        assert observability.tracer_provider is None
        observability.metrics.rpc_requests.add(1, {"rpc": "Generate", "code": "OK"})
        assert observability.metrics.provider.force_flush()
    finally:
        observability.close()
    assert "mmserve.rpc.requests" in otlp_receiver.metric_names


def test_vision_span_covers_the_encoder_call_and_bills_weights_once_per_step():
    """Two requests' frames encoded in one call: each vision span spans exactly the call the engine
    timed, its MFU is the call's (all frames over the call's time), each is billed its frames as run
    (padded to the longest) and a per-frame share of the encoder weights, read once for the step."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    perf = PerfModel(load_spec(CONFIG), dtype="float32")
    observer = TelemetryObserver(perf, PEAKS, tracer=provider.get_tracer("t"), step_trace_ratio=0)
    small, large = random.choice([8, 12]), random.choice([20, 24])
    parent = trace.set_span_in_context(provider.get_tracer("t").start_span("mmserve.generate"))
    a = Request("a", list(range(12)), SamplingParams(), mm_ranges=[(2, 3)], mm_inputs=[frame_input(small)],
                trace_context=parent)
    b = Request("b", list(range(12)), SamplingParams(), mm_ranges=[(1, 2), (5, 6)],
                mm_inputs=[frame_input(large), frame_input(small)], trace_context=parent)
    start_perf, start_ns = time.perf_counter(), time.time_ns()
    encode = (start_perf + 0.001, start_perf + 0.004)
    record = StepRecord(0, start_perf, start_perf + 0.01, start_ns, start_ns + 10_000_000,
                        [ScheduledItem("a", 12, 12, True, 1, request=a), ScheduledItem("b", 12, 12, True, 2, request=b)], 2, 0, 0.1,
                        encode_start_perf=encode[0], encode_end_perf=encode[1])
    observer.on_step(record)
    vision = {s.attributes["mmserve.vision.num_frames"]: s for s in exporter.get_finished_spans()
              if s.name == "mmserve.vision.encode"}
    assert set(vision) == {1, 2}
    for span in vision.values():
        assert span.start_time == start_ns + 1_000_000 and span.end_time == start_ns + 4_000_000
        assert span.attributes["mmserve.vision.padded_patches"] == large

    def frames(n: int, patches: int, tokens: int) -> PerfBreakdown:
        return perf.step(StepContext(images=(VisionWork(patches, tokens),) * n), per_gpu=True)

    call = frames(3, large, large // 4)
    weights = call.read_bytes["vision.weight"]
    for n, span in vision.items():
        own = frames(n, large, large // 4)
        assert span.attributes["mmserve.perf.flops"] == pytest.approx(own.total_flops)
        assert span.attributes["mmserve.perf.read_bytes"] == pytest.approx(
            own.total_read_bytes - own.read_bytes["vision.weight"] + weights * n / 3)
        assert span.attributes["mmserve.perf.mfu"] == pytest.approx(call.total_flops / (0.003 * PEAKS.flops), rel=1e-3)
    assert vision[1].attributes["mmserve.vision.useful_flops"] == pytest.approx(frames(1, small, 2).total_flops)
    useful_b = perf.step(StepContext(images=(VisionWork(large, 2), VisionWork(small, 2))), per_gpu=True)
    assert vision[2].attributes["mmserve.vision.useful_flops"] == pytest.approx(useful_b.total_flops)
    # Over the step the encoder's bytes add up to one call: weights read once, not once per request.
    assert sum(s.attributes["mmserve.perf.read_bytes"] for s in vision.values()) == pytest.approx(call.total_read_bytes)


def test_step_span_and_counter_carry_the_comm_bytes():
    """At tp=2 the step span's `mmserve.perf.comm_bytes` and `mmserve_perf_comm_bytes_total` are the
    step's interconnect bytes per GPU: the target's collectives plus the drafting round's, whose
    constrained request adds the drafts' broadcast; the HBM bytes (MBU's) are those of tp=2 alone."""
    import prometheus_client
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from mmserve.metrics.perf_model import DraftWork
    from mmserve.model.assistant_spec import AssistantSpec, DraftAttention
    from mmserve.sampling_params import ResponseFormat

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    drafter = AssistantSpec("gemma4_assistant", ("sliding_attention",),
                            {"sliding_attention": DraftAttention(4, 2, 16, 7)}, {}, 40, 64, 56, 512, 1e-6, True,
                            False, 0, 0)
    perf = PerfModel(load_spec(CONFIG), dtype="float32", tp=2, drafter=drafter)
    metrics = EngineMetrics(prometheus=True)
    observer = TelemetryObserver(perf, PEAKS, tracer=provider.get_tracer("t"), metrics=metrics, step_trace_ratio=1.0)
    free = Request("free", list(range(9)), SamplingParams())
    constrained = Request("constrained", list(range(5)), SamplingParams(response_format=ResponseFormat("regex", "a+")))
    keys = random.randint(6, 30)
    observer.on_step(StepClock().step([ScheduledItem("free", 9, 9, True, 0, request=free, draft_rows=3, draft_keys=9),
                                       ScheduledItem("constrained", 1, keys, False, 0, request=constrained, draft_rows=3,
                                                     draft_keys=keys)]))
    text = perf.step(StepContext((RequestWork(9, 9, True), RequestWork(1, keys, False))), per_gpu=True)
    drafting = perf.step(StepContext(drafts=(DraftWork(3, 9), DraftWork(3, keys, constrained=True))), per_gpu=True)
    assert drafting.comm_bytes["comm.drafter_token_broadcast"] == 3 * 2 * 8 / 2
    want = text.total_comm_bytes + drafting.total_comm_bytes
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "mmserve.engine.step"]
    assert span.attributes["mmserve.perf.comm_bytes"] == pytest.approx(want)
    assert span.attributes["mmserve.perf.read_bytes"] == pytest.approx(text.total_read_bytes + drafting.total_read_bytes)
    exposition = prometheus_client.generate_latest(metrics.registry).decode()
    (line,) = [x for x in exposition.splitlines() if x.startswith("mmserve_perf_comm_bytes_total{")]
    assert 'phase="mixed"' in line and float(line.rsplit(" ", 1)[1]) == pytest.approx(want)
    metrics.shutdown()
