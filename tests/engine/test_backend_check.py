"""The start-up self-check (worker/backend_check.py): a selected kernel that fails or disagrees with
the dense reference is replaced by its fallback before the first request, reported in GetModelInfo
and /metrics, and --strict-backends makes that a start-up failure.

On this CPU the check runs with --backend-self-check on over the flex backend; the failures are
forced (flex raising, or returning a wrong result), since the GPU faults it guards against cannot
happen here. One server for the module: the forced failure is patched before it starts.
"""

from __future__ import annotations

import urllib.request

import pytest
import torch
from loopback_server import LoopbackServer, engine_config
from prometheus_client.parser import text_string_to_metric_families

from mmserve.attention import flex
from mmserve.clients import Client
from mmserve.config import DEMO_MODEL_DIR, ServerConfig
from mmserve.engine.llm import LLM
from mmserve.metrics.perf_model import PerfModel
from mmserve.metrics.prometheus import EngineMetrics, start_metrics_server
from mmserve.metrics.telemetry import TelemetryObserver
from mmserve.model.spec import load_spec
from mmserve.sampling_params import SamplingParams
from mmserve.worker.backend_check import BackendCheckError, check_attention, graphs_mismatch

OPTIONS = dict(device="cpu", dtype="float32", attention_backend="flex", backend_self_check="on",
               max_num_seqs=4, max_num_batched_tokens=128, prefill_batched_tokens=0, kv_cache_bytes=8 * 2**20)
PROMPT = [2, 105, 2364, 107, 9259, 236888, 106, 107, 105, 4368, 107]


def broken_flex(self, *args, **kwargs):
    raise RuntimeError("forced: flex kernel failed to compile")


def test_a_failing_backend_falls_back_and_serves_the_same_tokens(monkeypatch):
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    want = LLM(model=str(DEMO_MODEL_DIR), **{**OPTIONS, "attention_backend": "sdpa"}).generate([PROMPT], greedy)
    monkeypatch.setattr(flex.FlexImpl, "forward", broken_flex)
    llm = LLM(model=str(DEMO_MODEL_DIR), **OPTIONS)
    checks = llm.core.runner.backend_checks
    assert {c.component for c in checks} == set(llm.core.model.spec.attention_specs)
    for c in checks:
        assert (c.selected, c.running) == ("flex", "sdpa") and "forced: flex kernel failed" in c.reason
    assert set(llm.core.model.attention_backends.values()) == {"sdpa"}
    assert all(type(layer.self_attn.impl).__name__ == "SdpaImpl" for layer in llm.core.model.decoder.layers)
    assert llm.generate([PROMPT], greedy)[0].token_ids == want[0].token_ids


def test_strict_backends_refuses_to_start(monkeypatch):
    monkeypatch.setattr(flex.FlexImpl, "forward", broken_flex)
    with pytest.raises(BackendCheckError, match="flex failed its start-up check.*strict-backends"):
        LLM(model=str(DEMO_MODEL_DIR), **OPTIONS, strict_backends=True)


def test_a_wrong_result_is_a_failure_and_a_right_one_passes(monkeypatch):
    """The check compares numbers, not just that the kernel ran: flex is right on this CPU and stays;
    the same flex off by 10% falls back, named with its error."""
    llm = LLM(model=str(DEMO_MODEL_DIR), **{**OPTIONS, "attention_backend": "sdpa", "backend_self_check": "off"})
    runner, model = llm.core.runner, llm.core.model
    one_type = next(iter(runner.pools))   # one layer type: flex compiles once per type on this CPU
    pools = {one_type: runner.pools[one_type]}
    model.attention_backends[one_type] = "flex"
    assert [(c.selected, c.running) for c in check_attention(model, pools, runner.kv_caches, strict=False)] == [
        ("flex", "flex")]
    real = flex.FlexImpl.forward
    monkeypatch.setattr(flex.FlexImpl, "forward", lambda self, *a: real(self, *a) * 1.1)
    (result,) = check_attention(model, pools, runner.kv_caches, strict=False)
    assert (result.selected, result.running) == ("flex", "sdpa") and "max error" in result.reason
    assert all(float(c.abs().max()) == 0 for c in runner.kv_caches)   # the check leaves the cache as it found it


def test_graph_replay_comparison():
    """Real rows against the eager forward (NaN where it is NaN); padding rows finite and the same
    over other garbage in the null block."""
    eager, pad = torch.randn(4, 8), torch.randn(2, 8)
    assert graphs_mismatch(eager.clone(), eager, pad, pad.clone()) is None
    assert "max error" in graphs_mismatch(eager * 1.5, eager, pad, pad.clone())
    nan_row = eager.clone()
    nan_row[3] = float("nan")
    assert graphs_mismatch(nan_row, nan_row.clone(), pad, pad.clone()) is None
    assert "NaN" in graphs_mismatch(nan_row, eager, pad, pad.clone())
    assert "not finite" in graphs_mismatch(eager.clone(), eager, nan_row, nan_row)
    assert "null block" in graphs_mismatch(eager.clone(), eager, pad, pad * 2)


@pytest.fixture(scope="module")
def fallen_back_server():
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(flex.FlexImpl, "forward", broken_flex)
    metrics = EngineMetrics(prometheus=True)
    observer = TelemetryObserver(PerfModel(load_spec(DEMO_MODEL_DIR), dtype="float32"), metrics=metrics)
    config = engine_config(DEMO_MODEL_DIR, engine_process=False, **{k: v for k, v in OPTIONS.items()
                                                                     if k not in ("device", "dtype")})
    server = LoopbackServer(config, ServerConfig(port=0, worker_threads=2), observer=observer, metrics=metrics).start()
    try:
        yield server, metrics
    finally:
        server.stop()
        metrics.shutdown()
        monkeypatch.undo()


def test_model_info_and_metrics_report_the_fallback(fallen_back_server):
    server, metrics = fallen_back_server
    with Client(server.address, timeout=60) as client:
        info = client.model_info()
        assert info.attention_backend == "sdpa"
        checks = {c.component: c for c in info.backend_checks}
        assert set(checks) == set(load_spec(DEMO_MODEL_DIR).attention_specs)
        assert all((c.selected, c.running) == ("flex", "sdpa") and "forced" in c.reason for c in checks.values())
        assert client.generate(prompt="Hi", max_tokens=3, temperature=0.0).text is not None   # it serves
    http, port = start_metrics_server(0, metrics, addr="127.0.0.1")
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        http.shutdown()
    infos = [s for family in text_string_to_metric_families(text) for s in family.samples
             if s.name == "mmserve_backend_info"]
    assert {(s.labels["component"], s.labels["selected"], s.labels["running"]) for s in infos} == {
        (c, "flex", "sdpa") for c in checks}
    assert all("forced" in s.labels["fallback_reason"] and s.value == 1 for s in infos)
