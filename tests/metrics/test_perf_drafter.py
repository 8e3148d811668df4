"""The perf model bills the speculative drafter: a hand count over a fresh random tiny assistant.

Every matmul of the assistant is an nn.Linear (or the tied/centroid head), so a draft step's
projection FLOPs are 2 * (their parameters) * rows; its attention core adds 2 * 2 * heads *
head_dim per (query, key) pair, each draft row seeing the target's keys before the drafted-from
token (the last window + 1 on sliding layers). Its weights are read once per draft step. A step
that drafts nothing is billed exactly as by a model without a drafter.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn
from transformers import Gemma4AssistantConfig

from mmserve.metrics.perf_model import DraftWork, PerfModel, RequestWork, StepContext
from mmserve.model.assistant import Assistant
from mmserve.model.assistant_spec import load_assistant_spec
from mmserve.model.spec import load_spec


def random_assistant(fixtures, tmp_path, rng: random.Random, *, ordered: bool):
    target = fixtures.tiny_config(window=rng.randint(3, 9))
    cfg = fixtures.assistant_config(target, ordered=ordered, hidden=rng.choice([24, 40, 56]),
                                    intermediate_size=2 * rng.randint(10, 45), num_attention_heads=rng.choice([2, 4, 6]))
    path = tmp_path / f"assistant-{ordered}"
    path.mkdir()
    Gemma4AssistantConfig(**cfg).to_json_file(str(path / "config.json"))
    spec = load_assistant_spec(path)
    with torch.device("meta"):
        model = Assistant(spec)
    return dict(target["text_config"], model_type="gemma4_text"), spec, model


def hand_count(spec, model: Assistant, drafts: list[DraftWork], tp: int = 1) -> tuple[float, float]:
    """(FLOPs, weight bytes at bf16) of the draft steps, from the module's own parameters (one rank's
    shard at `tp` > 1: the centroid head scores its share of the selected rows, on average)."""
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    head = spec.hidden_size * spec.centroid_top_k * spec.vocab_size / spec.num_centroids / tp \
        if spec.use_ordered_embeddings else 0 if model.lm_head is not None else model.head_weight.numel()
    flops = weights = 0.0
    for step in range(max(d.num_rows for d in drafts)):
        active = [d for d in drafts if d.num_rows > step]
        flops += 2 * (linear + head) * len(active)
        weights += (linear + (head * len(active) if spec.use_ordered_embeddings else head)) * 2
        for t in spec.layer_types:
            a = spec.attention[t]
            pairs = sum(d.num_keys if a.window is None else min(d.num_keys, a.window + 1) for d in active)
            flops += 2 * 2 * a.num_heads / tp * a.head_dim * pairs
    return flops, weights


def test_drafter_flops_and_weight_reads_equal_a_hand_count(gemma4_fixtures, tmp_path):
    rng = random.Random(random.getrandbits(64))
    for ordered in (False, True):
        target, spec, model = random_assistant(gemma4_fixtures, tmp_path, rng, ordered=ordered)
        perf = PerfModel(load_spec(target), drafter=spec)
        drafts = [DraftWork(rng.randint(1, 4), rng.randint(1, 40)) for _ in range(rng.randint(1, 4))]
        got = perf.step(StepContext(drafts=tuple(drafts))).component("drafter")
        flops, weights = hand_count(spec, model, drafts)
        assert got.total_flops == flops, (ordered, drafts)
        assert sum(v for k, v in got.read_bytes.items() if k.endswith("_weight")) == weights, (ordered, drafts)
        assert got.write_bytes["drafter.kv_cache"] == 0   # it reads the target's K/V, writes none


def test_drafter_per_gpu_at_tp2_equals_a_hand_count_over_one_ranks_shard(gemma4_fixtures, tmp_path):
    """Under tensor parallelism each rank runs its shard of the drafter (model/assistant.py): per GPU,
    the model bills that shard's matmuls and weights, not the whole drafter."""
    from mmserve.model.parallel import ParallelGroup

    rng = random.Random(random.getrandbits(64))
    for ordered in (False, True):
        target, spec, whole = random_assistant(gemma4_fixtures, tmp_path, rng, ordered=ordered)
        with torch.device("meta"):
            shard = Assistant(spec, ParallelGroup(0, 2))
        perf = PerfModel(load_spec(target), drafter=spec, tp=2)
        drafts = [DraftWork(rng.randint(1, 4), rng.randint(1, 40)) for _ in range(rng.randint(1, 4))]
        got = perf.step(StepContext(drafts=tuple(drafts)), per_gpu=True).component("drafter")
        flops, weights = hand_count(spec, shard, drafts, tp=2)
        assert got.total_flops == pytest.approx(flops, rel=1e-12), (ordered, drafts)
        assert sum(v for k, v in got.read_bytes.items() if k.endswith("_weight")) == pytest.approx(weights, rel=1e-12)
        assert got.total_flops < 0.8 * perf.step(StepContext(drafts=tuple(drafts))).component("drafter").total_flops


def test_a_step_without_drafts_is_billed_as_without_a_drafter(gemma4_fixtures, tmp_path):
    rng = random.Random(random.getrandbits(64))
    target, spec, _ = random_assistant(gemma4_fixtures, tmp_path, rng, ordered=False)
    requests = (RequestWork(rng.randint(2, 30), 60, True), RequestWork(1 + rng.randint(0, 3), rng.randint(5, 50), False))
    plain, with_drafter = PerfModel(load_spec(target)), PerfModel(load_spec(target), drafter=spec)
    assert with_drafter.step(StepContext(requests)).as_dict() == plain.step(StepContext(requests)).as_dict()
    # drafting adds its own component and leaves the target's (verify rows included) as they were
    drafted = with_drafter.step(StepContext(requests, drafts=(DraftWork(3, 20),)))
    assert drafted.component("drafter").total_flops > 0
    for name in ("attn", "ffn", "unembed"):
        assert drafted.component(name).as_dict() == plain.step(StepContext(requests)).component(name).as_dict()


def test_telemetry_bills_each_request_its_draft_rows_and_the_step_its_useful_tokens(gemma4_fixtures, tmp_path):
    """A verify chunk (4 rows, 1 draft kept: 2 tokens out) and a plain decode both draft 3 rows after
    the step, a third request drafts nothing: the step's FLOPs are the target's rows plus the
    drafter's, each drafting request carries half the drafter's work, and the step span tells the
    tokens emitted apart from the rows run."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from mmserve.ipc.records import ScheduledItem, StepRecord
    from mmserve.metrics.peaks import DevicePeaks
    from mmserve.metrics.telemetry import TelemetryObserver
    from mmserve.request import Request
    from mmserve.sampling_params import SamplingParams

    target, spec, _ = random_assistant(gemma4_fixtures, tmp_path, random.Random(random.getrandbits(64)), ordered=False)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    perf = PerfModel(load_spec(target), drafter=spec)
    observer = TelemetryObserver(perf, DevicePeaks("test", 1e9, 1e9, "test"), tracer=provider.get_tracer("t"),
                                 step_trace_ratio=1)
    parent = trace.set_span_in_context(provider.get_tracer("t").start_span("mmserve.generate"))
    reqs = {rid: Request(rid, list(range(20)), SamplingParams(), trace_context=parent) for rid in "abc"}
    items = [ScheduledItem("a", 4, 30, False, 0, request=reqs["a"], draft_tokens=3, accepted_drafts=1, emitted_tokens=2,
                           draft_rows=3, draft_keys=28),
             ScheduledItem("b", 1, 25, False, 0, request=reqs["b"], emitted_tokens=1, draft_rows=3, draft_keys=25),
             ScheduledItem("c", 1, 22, False, 0, request=reqs["c"], emitted_tokens=1)]
    for r in reqs.values():
        observer.on_request_queued(r)
    observer.on_step(StepRecord(0, 1.0, 1.01, 10**9, 10**9 + 10**7, items, 3, 0, 0.1))
    rows = tuple(RequestWork(i.num_tokens, i.context_len, False) for i in items)
    text = perf.step(StepContext(rows), per_gpu=True)
    drafter = perf.step(StepContext(drafts=(DraftWork(3, 28), DraftWork(3, 25))), per_gpu=True)
    step = next(s for s in exporter.get_finished_spans() if s.name == "mmserve.engine.step")
    assert step.attributes["mmserve.perf.flops"] == pytest.approx(text.total_flops + drafter.total_flops)
    assert step.attributes["mmserve.step.emitted_tokens"] == 4
    assert step.attributes["mmserve.step.decode_tokens"] == 6   # rows run: verify rows are work, not output
    assert step.attributes["mmserve.step.draft_rows"] == 6
    for r in reqs.values():   # request.perf is set as a request ends (the final message is what carries it)
        observer.on_request_finished(r, "length", None)
    assert reqs["a"].perf["flops"] == pytest.approx(text.total_flops * 4 / 6 + drafter.total_flops / 2)
    assert reqs["b"].perf["flops"] == pytest.approx(text.total_flops / 6 + drafter.total_flops / 2)
    assert reqs["c"].perf["flops"] == pytest.approx(text.total_flops / 6)
