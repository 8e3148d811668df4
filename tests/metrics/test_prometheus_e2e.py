"""A real Prometheus (Debian's `prometheus`, exemplar storage on, 1 s scrapes) scraping a real
`mmserve serve` process under a mixed load, then asked through its HTTP API:

- every panel query of the shipped Grafana dashboard returns data, finite, over the run, and the
  labels its `by (...)` groups on carry values;
- the latency histograms' exemplars name the traces of the requests just sent;
- the `vllm:*` compatibility gauges rose with the load and read idle after it;
- the shipped alert rules (a copy with `for: 1s` and 10 s windows) evaluate without error, and
  "error rate" and "not serving" fire and resolve against the real server.

Name matching cannot see a broken PromQL expression, a label that never carries a value or an
exemplar Prometheus refuses; only Prometheus itself can. Skips with the install command where
Prometheus is absent, unless CI is set (.ci/run installs it through `make setup-prometheus`).

The load's short states (the batch full with some waiting, the live session open) are held until
Prometheus has stored them, and the checks read windows that cover the whole run: the load lasts
~2 s on a quiet machine, where one or two scrapes land in it, and on a loaded one a scrape can
outlast its 1 s timeout and store nothing (a failed scrape stores `up` 0 and marks the target's
series stale). Failures print the scrapes' `up` and durations, to tell the two apart.
"""

from __future__ import annotations

import io
import itertools
import math
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import yaml
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from PIL import Image

from mmserve.clients import Client
from mmserve.clients.messages import image_part, message, text_part, video_part
from mmserve.clients.types import ClientError
from mmserve.config import DEMO_ASSISTANT_DIR, DEMO_MODEL_DIR, EngineConfig
from mmserve.metrics.tracing import inject_trace_context
from mmserve.server.health import GENERATION_SERVICE

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from local_prometheus import (  # noqa: E402
    ALERT_RULES,
    INSTALL_HINT,
    LocalPrometheus,
    binary,
    dashboard_queries,
    free_port,
    in_ci,
)

LATENCY_HISTOGRAMS = ("mmserve_time_to_first_token_seconds", "mmserve_time_per_output_token_seconds",
                      "mmserve_e2e_request_latency_seconds", "mmserve_request_queue_time_seconds")
MAX_NUM_SEQS = 2   # with more long requests than this, some wait: the waiting gauges must show it
TEXT_REQUESTS = 5   # requests kept outstanding until a stored scrape shows the batch full
LIVE_FRAMES = 3
# A full batch, some waiting, KV in use: (gauge, its bound), each held until a stored scrape shows it.
BATCH_FULL = (("vllm:num_requests_running", f">= {MAX_NUM_SEQS}"), ("vllm:num_requests_waiting", ">= 1"),
              ("vllm:kv_cache_usage_perc", "> 0"))
# A held state not shown by this many successful scrapes is not coming (the test's assertion says so);
# a hold without that many within the wall-clock limit means scrapes fail (its failure prints them).
HOLD_SCRAPES = 10
HOLD_TIMEOUT_S = 180.0


def _require_prometheus() -> None:
    if binary("prometheus") is None:
        if in_ci():
            pytest.fail(f"CI is set but prometheus is not installed (make setup-prometheus: {INSTALL_HINT})")
        pytest.skip(f"prometheus is not installed: {INSTALL_HINT}")


def _quick_rules(tmp_path: Path) -> Path:
    """The shipped rules with durations a test can wait for: every `for:` 1 s, 5 m windows 10 s."""
    rules = yaml.safe_load(ALERT_RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule["for"] = "1s"
            rule["expr"] = rule["expr"].replace("[5m]", "[10s]")
    path = tmp_path / "alerts.yaml"
    path.write_text(yaml.safe_dump(rules))
    return path


class ServeProcess:
    """`python -m mmserve.cli serve` with its log kept (read on a thread so the pipe never fills)."""

    def __init__(self, *args: str):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "mmserve.cli", "serve", *args], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.port: int | None = None
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if self.port is None and (m := re.search(r"listening on [\d.]+:(\d+)", line)):
                self.port = int(m.group(1))

    def wait_serving(self, timeout_s: float = 180) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None and time.monotonic() < deadline, "".join(self.lines[-30:])
            if self.port is not None:
                try:
                    with Client(f"127.0.0.1:{self.port}", timeout=2) as client:
                        if client.health(GENERATION_SERVICE) == "SERVING":
                            return f"127.0.0.1:{self.port}"
                except ClientError:
                    pass
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)   # in case a test left it stopped
            self.proc.kill()
            self.proc.wait(30)


@dataclass
class Run:
    prometheus: LocalPrometheus
    server: ServeProcess
    address: str
    metrics_target: str
    started: float   # before the first scrape of the serving engine (before the load): windows reach back to it
    traced: set[str] = field(default_factory=set)   # trace ids of the requests the engine ran
    load_end: float = 0.0


def _traced_client(address: str) -> tuple[Client, str]:
    """A client whose calls continue a fresh trace (W3C traceparent, as an instrumented caller sends)."""
    span = TracerProvider().get_tracer("test").start_span("client.generate")
    metadata = inject_trace_context(context=trace.set_span_in_context(span))
    return Client(address, timeout=120, metadata=metadata), format(span.get_span_context().trace_id, "032x")


def _png(seed: int, size: int = 48) -> bytes:
    rng = random.Random(seed)
    out = io.BytesIO()
    Image.frombytes("RGB", (size, size), rng.randbytes(size * size * 3)).save(out, format="PNG")
    return out.getvalue()


def _mixed_load(run: Run, video: bytes, image: bytes) -> None:
    """Long text requests (TEXT_REQUESTS, more than MAX_NUM_SEQS, each sent again as it ends until a
    stored scrape shows the batch full and some waiting), a video asked twice (the second hits the
    prefix cache), a stream cancelled while decoding, two refused requests and a live session (held
    open until a stored scrape shows it), concurrently."""
    batch_held = threading.Event()
    began = time.time()

    def text(i: int) -> None:
        for repeat in itertools.count():
            client, trace_id = _traced_client(run.address)
            with client:
                result = client.generate(prompt=f"Count to a thousand, {i}.{repeat}", max_tokens=300,
                                         ignore_eos=True, temperature=0)
            assert len(result.token_ids) == 300
            run.traced.add(trace_id)
            if batch_held.is_set():
                return

    def hold_the_batch() -> None:
        try:
            _hold_until_stored(run, "the batch full and some waiting", began,
                               lambda window: all(run.prometheus.query(f"max_over_time({gauge}{window}) {bound}")
                                                  for gauge, bound in BATCH_FULL))
        finally:
            batch_held.set()

    def video_twice() -> None:
        for _ in range(2):
            client, trace_id = _traced_client(run.address)
            with client:
                result = client.generate(prompt="What happens?", video=video, num_frames=4, max_tokens=8, temperature=0)
            run.traced.add(trace_id)
        assert result.usage.cached_tokens > 0
        client, trace_id = _traced_client(run.address)   # other text first: the frames' K/V is computed again,
        with client:                                     # their embeddings come from the encoder cache
            client.generate([message("user", text_part("Before you answer, think."), video_part(video, num_frames=4))],
                            max_tokens=4, temperature=0)
            for question in ("What is this?", "Describe it."):   # an image, then the same after other text
                client.generate([message("user", text_part(question), image_part(image))], max_tokens=4, temperature=0)
        run.traced.add(trace_id)

    def cancelled() -> None:
        client, trace_id = _traced_client(run.address)
        with client:
            stream = client.stream(prompt="Count forever.", max_tokens=500, ignore_eos=True)
            for seen, _ in enumerate(stream, 1):
                if seen == 3:
                    break
            stream.cancel()
        run.traced.add(trace_id)

    def refused() -> None:
        client, _ = _traced_client(run.address)
        with client, pytest.raises(ClientError) as info:
            client.generate(prompt="hi", max_tokens=-1)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT

    def live_session() -> None:
        """A live session of LIVE_FRAMES frames and a question: the live metrics' series."""
        client, trace_id = _traced_client(run.address)   # its question's latencies are exemplars too
        with client:
            opened = time.time()
            call = client.live()
            for i in range(LIVE_FRAMES):
                image = io.BytesIO()
                Image.new("RGB", (16, 16), (40 * i, 80, 120)).save(image, "PNG")
                call.frame(image.getvalue(), i / 2)
            for response in call:
                if response.WhichOneof("kind") == "progress" and response.progress.frames_prefilled == LIVE_FRAMES:
                    break
            _hold_until_stored(run, "the live session open", opened,
                               lambda window: run.prometheus.query(f"max_over_time(mmserve_live_sessions{window}) == 1"))
            call.ask("What moves?", max_tokens=4)
            call.close()
            assert any(r.WhichOneof("kind") == "answer" and r.answer.WhichOneof("kind") == "final" for r in call)
        run.traced.add(trace_id)

    jobs = [lambda i=i: text(i) for i in range(TEXT_REQUESTS)] + [hold_the_batch, video_twice, cancelled, refused,
                                                                 refused, live_session]
    with ThreadPoolExecutor(len(jobs)) as pool:
        for future in [pool.submit(job) for job in jobs]:
            future.result()


def _poll(what: str, check, timeout_s: float = 30.0, every_s: float = 0.25, detail=lambda: ""):
    """check() until it returns something truthy; fails with `what`, the last value and detail() at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: still {value!r} after {timeout_s}s{detail()}"
        time.sleep(every_s)


def _value(prometheus: LocalPrometheus, expr: str) -> float | None:
    result = prometheus.query(expr)
    return float(result[0]["value"][1]) if result else None


def _duration_since(start: float) -> str:
    """From `start` (epoch seconds) to now, rounded out to whole milliseconds, as PromQL writes it."""
    return f"{math.ceil((time.time() - start) * 1000)}ms"


def _since(start: float) -> str:
    """A range selector from `start` to now: a window over the run, however long a loaded machine made it."""
    return f"[{_duration_since(start)}]"


def _scrapes_since(prometheus: LocalPrometheus, start: float) -> int:
    """Successful scrapes of the server that began after `start` (a failed one stores `up` 0)."""
    window_ms = math.floor((time.time() - start) * 1000)
    return int(_value(prometheus, f"sum_over_time(up[{window_ms}ms])") or 0) if window_ms > 0 else 0


def _scrape_log(prometheus: LocalPrometheus, start: float) -> str:
    """The scrapes since `start`: how many failed (a 1 s timeout on a loaded machine, say), and their durations."""
    window = _since(start)
    up = [(float(t), v) for s in prometheus.query(f"up{window}") for t, v in s["values"]]
    durations = sorted(float(v) for s in prometheus.query(f"scrape_duration_seconds{window}") for _, v in s["values"])
    failed = [round(t - start, 1) for t, v in up if v != "1"]
    slowest = ", ".join(f"{d * 1e3:.0f}" for d in durations[-5:])
    return (f"\n    scrapes since then: {len(up)}, failed (up 0) at {failed} s after it; slowest durations "
            f"(ms): {slowest}")


def _hold_until_stored(run: Run, what: str, start: float, stored) -> None:
    """Returns once stored(window since `start`) is true: the caller holds its state until then. Also
    once HOLD_SCRAPES successful scrapes since `start` have not shown it: a state they all missed is not
    shown by the metrics, and the test's own assertion fails. A failed scrape does not count."""
    p = run.prometheus
    held = time.time()
    _poll(f"{what}: neither stored nor {HOLD_SCRAPES} successful scrapes",
          lambda: stored(_since(start)) or _scrapes_since(p, start) >= HOLD_SCRAPES, timeout_s=HOLD_TIMEOUT_S,
          detail=lambda: _scrape_log(p, start))
    print(f"{what}: {'stored' if stored(_since(start)) else 'NOT shown'} {time.time() - start:.1f} s after it "
          f"began, held {time.time() - held:.1f} s for that{_scrape_log(p, start)}")


@pytest.fixture(scope="module")
def run(tmp_path_factory, make_video, served_model):
    _require_prometheus()
    from otlp_receiver import OtlpReceiver

    receiver = OtlpReceiver()   # tracing on: only sampled requests' histograms carry exemplars
    metrics_port = free_port()
    target = f"127.0.0.1:{metrics_port}"
    drafter = ("--speculative-model", str(DEMO_ASSISTANT_DIR)) if served_model == DEMO_MODEL_DIR else ()
    server = ServeProcess("--model", str(served_model), "--host", "127.0.0.1", "--port", "0",
                          "--metrics-port", str(metrics_port), "--otlp-traces-endpoint", receiver.endpoint, "--max-num-seqs", str(MAX_NUM_SEQS),
                          "--kv-cache-bytes", str(16 * 2**20), "--engine-threads", "1",
                          "--live-idle-timeout-s", str(2 * HOLD_TIMEOUT_S), *drafter)
    prometheus = LocalPrometheus([target], rule_files=[_quick_rules(tmp_path_factory.mktemp("rules"))],
                                 interval_s=1.0)
    try:
        prometheus.start()   # while the model loads
        address = server.wait_serving()
        serving = time.time()
        # a scrape of the serving engine's zeros before any load (series it adds at ready, e.g.
        # speculation's positions): "up" alone may be a scrape from while the model loaded
        _poll("a successful scrape after the engine was ready", lambda: _scrapes_since(prometheus, serving) >= 1,
              timeout_s=HOLD_TIMEOUT_S, detail=lambda: _scrape_log(prometheus, serving))
        state = Run(prometheus, server, address, target, started=serving)
        _mixed_load(state, make_video(seed=11, num_frames=8), _png(12))
        state.load_end = time.time()
        yield state
    finally:
        server.stop()
        prometheus.stop()
        receiver.stop()


def _grouped_labels(expr: str) -> set[str]:
    """Labels the expression's `by (...)` clauses keep (histogram_quantile consumes `le`)."""
    return {label.strip() for group in re.findall(r"\bby\s*\(([^)]*)\)", expr) for label in group.split(",")} - {"le", ""}


def test_every_dashboard_query_returns_finite_data(run):
    """Over the whole run (from before the load to now), not the dashboard's last minute: a minute
    with no increase in it (a load a loaded machine stretched past it, or scrapes failed through it)
    makes rate() 0 and the ratios and quantiles over it NaN."""
    # Two successful scrapes after the load's end: a series born in its last moments (the cancelled
    # request's finish reason) needs two samples for rate().
    p = run.prometheus
    _poll("two successful scrapes after the load", lambda: _scrapes_since(p, run.load_end) >= 2, timeout_s=60,
          detail=lambda: _scrape_log(p, run.load_end))
    failures = []
    queries = dashboard_queries(rate_interval=_duration_since(run.started))
    assert len(queries) >= 20
    for title, expr in queries:
        try:
            result = run.prometheus.query(expr)
        except ValueError as e:   # Prometheus refused the expression: its message says why
            failures.append(f"{title}: {e}")
            continue
        values = [float(series["value"][1]) for series in result]
        if not values or not all(math.isfinite(v) for v in values):
            failures.append(f"{title}: {expr}\n    -> {values or 'no data'}")
        for label in _grouped_labels(expr):
            if not all(series["metric"].get(label) for series in result):
                failures.append(f"{title}: a series without a value for `{label}`: {result}")
    assert not failures, "\n".join(failures) + _scrape_log(p, run.started)


def test_latency_exemplars_name_the_traces_just_sent(run):
    """Every latency histogram has exemplars; each names one of our requests' traces and lies in its bucket."""
    for histogram in LATENCY_HISTOGRAMS:
        found = run.prometheus.exemplars(f"{histogram}_bucket", seconds=120)
        exemplars = [(series["seriesLabels"], e) for series in found for e in series["exemplars"]]
        assert exemplars, f"no exemplars stored for {histogram}"
        for series, exemplar in exemplars:
            assert exemplar["labels"].get("trace_id") in run.traced, (histogram, exemplar, sorted(run.traced))
            assert re.fullmatch(r"[0-9a-f]{16}", exemplar["labels"].get("span_id", "")), exemplar
            assert float(exemplar["value"]) <= float(series["le"]), (histogram, series, exemplar)


def test_vllm_gauges_follow_the_load_and_return_to_idle(run):
    """The load held the batch full, some waiting and KV in use until a successful scrape stored it
    (or HOLD_SCRAPES of them did not): the gauges show it over the run, and read idle after it."""
    p = run.prometheus
    window = _since(run.started)
    for gauge, bound in BATCH_FULL:
        assert p.query(f"max_over_time({gauge}{window}) {bound}"), \
            f"{gauge} never {bound}: {p.query(f'max_over_time({gauge}{window})')}{_scrape_log(p, run.started)}"
    idle = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "mmserve_requests_running", "mmserve_requests_waiting", "max(mmserve_kv_cache_usage)")
    _poll("idle gauges after the load", lambda: all(_value(p, name) == 0 for name in idle))
    (info,) = p.query("vllm:cache_config_info")
    assert int(info["metric"]["block_size"]) > 0 and int(info["metric"]["num_gpu_blocks"]) > 0
    # Same semantics as ours: tokens looked up at admission, and those found in the cache.
    for name in ("queries", "hits"):
        vllm = _value(p, f"sum(vllm:prefix_cache_{name}_total)")
        assert vllm == _value(p, f"sum(mmserve_prefix_cache_{name}_total)") and vllm > 0, name
    (series,) = p.query("vllm:num_requests_running")
    assert set(series["metric"]) >= {"model_name", "engine"}


def test_counters_with_known_labels_start_at_zero_and_match_ours(run, served_model):
    """The encoder cache by modality, speculation under vLLM's names and the KV event drops: every
    series with a label value known at start was scraped at 0 before it counted (min over the run is
    0), and each carries the meaning it claims (encoder-cache misses are the frames the vision tower
    ran; vLLM's speculation counters are ours, position for position)."""
    p = run.prometheus
    _poll("a successful scrape after the load", lambda: _scrapes_since(p, run.load_end) >= 1, timeout_s=60,
          detail=lambda: _scrape_log(p, run.load_end))
    for modality in ("image", "video", "audio"):
        for name in ("queries", "hits"):
            series = f'mmserve_encoder_cache_{name}_total{{modality="{modality}"}}'
            assert _value(p, f"min_over_time({series}[10m])") == 0, series
    for modality in ("image", "video"):
        assert _value(p, f'mmserve_encoder_cache_hits_total{{modality="{modality}"}}') > 0, modality
    misses = _value(p, "sum(mmserve_encoder_cache_queries_total) - sum(mmserve_encoder_cache_hits_total)")
    assert misses == _value(p, "mmserve_vision_frames_encoded_total") > 0
    for reason in ("publisher_queue_full", "publisher_lagging"):
        assert _value(p, f'max_over_time(mmserve_kv_events_dropped_total{{reason="{reason}"}}[10m])') == 0
    if served_model != DEMO_MODEL_DIR:
        return   # no drafter for another model
    positions = EngineConfig().num_speculative_tokens
    for name in ("mmserve_speculative_accepted_tokens_total", "mmserve_speculative_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_per_pos_total"):
        series = p.query(f"min_over_time({name}[10m])")
        assert sorted(int(s["metric"]["position"]) for s in series) == list(range(positions)), name
        assert all(float(s["value"][1]) == 0 for s in series), name
    for ours, theirs in (("mmserve_speculative_verify_chunks_total", "vllm:spec_decode_num_drafts_total"),
                         ("sum(mmserve_speculative_draft_tokens_total)", "vllm:spec_decode_num_draft_tokens_total"),
                         ("sum(mmserve_speculative_accepted_tokens_total)", "vllm:spec_decode_num_accepted_tokens_total")):
        assert _value(p, f"sum({theirs})") == _value(p, ours) > 0, theirs
    for position in range(positions):
        assert _value(p, f'sum(vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{position}"}})') == \
            _value(p, f'sum(mmserve_speculative_accepted_tokens_total{{position="{position}"}})')


def test_live_session_metrics(run):
    """The live session of the load (held open until a successful scrape stored it, or HOLD_SCRAPES
    did not): Prometheus stored it open while it ran, then closed, and every frame it sent
    prefilled, its lag observed at each progress report; each series was there at 0 before the
    session. The counters are read as last stored: after a failed scrape a plain read finds nothing."""
    p = run.prometheus
    window = _since(run.started)
    assert _value(p, f"max_over_time(mmserve_live_sessions{window})") == 1, _scrape_log(p, run.started)
    _poll("the live session closed", lambda: _value(p, "mmserve_live_sessions") == 0,
          detail=lambda: _scrape_log(p, run.started))
    assert _value(p, f"last_over_time(mmserve_live_frames_prefilled_total{window})") == LIVE_FRAMES
    assert _value(p, f"last_over_time(mmserve_live_lag_seconds_count{window})") >= 1
    for name in ("mmserve_live_frames_prefilled_total", "mmserve_live_frames_dropped_total",
                 "mmserve_live_rollovers_total", "mmserve_live_sessions"):   # exported at 0 from the start
        assert _value(p, f"min_over_time({name}[10m])") == 0, name


def test_every_shipped_rule_evaluates(run):
    def evaluated():
        rules = [r for g in run.prometheus.api("rules")["groups"] for r in g["rules"]]
        return rules if all(not r["lastEvaluation"].startswith("0001") for r in rules) else None

    rules = _poll("every rule evaluated once", evaluated)
    assert {r["name"] for r in rules} == {r["alert"] for g in yaml.safe_load(ALERT_RULES.read_text())["groups"]
                                          for r in g["rules"]}
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]


def test_error_rate_alert_fires_by_code_and_resolves(run):
    p = run.prometheus
    with Client(run.address, timeout=30) as client:
        def refuse_and_check():
            with pytest.raises(ClientError):
                client.generate(prompt="hi", temperature=-0.5)
            alerts = p.api("alerts")["alerts"]
            return [a for a in alerts if a["labels"]["alertname"] == "MMServeHighErrorRate" and a["state"] == "firing"]

        (alert,) = _poll("MMServeHighErrorRate firing", refuse_and_check, timeout_s=40, every_s=0.5)
    assert alert["labels"]["code"] == "INVALID_ARGUMENT"
    _poll("MMServeHighErrorRate resolved", lambda: "MMServeHighErrorRate" not in p.alerts(), timeout_s=40)


def test_not_serving_alert_fires_and_resolves(run):
    """A stopped (hung) server: its scrapes time out, `up` is 0, the alert fires; it resolves once it runs."""
    p = run.prometheus
    assert "MMServeNotServing" not in p.alerts()
    os.kill(run.server.proc.pid, signal.SIGSTOP)
    try:
        _poll("MMServeNotServing firing", lambda: p.alerts().get("MMServeNotServing") == "firing", timeout_s=40)
        assert _value(p, f'up{{instance="{run.metrics_target}"}}') == 0
    finally:
        os.kill(run.server.proc.pid, signal.SIGCONT)
    _poll("MMServeNotServing resolved", lambda: "MMServeNotServing" not in p.alerts(), timeout_s=40)
    with Client(run.address, timeout=60) as client:   # and it serves again
        assert len(client.generate(prompt="Still there?", max_tokens=3, ignore_eos=True).token_ids) == 3
