"""Speculative decoding through the real server (engine process, gRPC on loopback): a request's
greedy tokens with speculation equal the same request's with `disable_speculation`, over chunked
prefill, a prefix-cache hit, a video and a stop string; nothing is held at the end.

The model is a fresh random tiny Gemma 4 with a tiny assistant that mostly drafts the token it is
given (gemma4_fixtures.make_assistant(copy_from=...)), so drafts are both accepted and rejected."""

from __future__ import annotations

import time
import urllib.request

import pytest
from loopback_server import LoopbackServer, engine_config

from mmserve.clients import Client
from mmserve.config import ServerConfig
from mmserve.metrics.peaks import DevicePeaks
from mmserve.metrics.perf_model import PerfModel
from mmserve.metrics.prometheus import EngineMetrics, start_metrics_server
from mmserve.metrics.telemetry import TelemetryObserver
from mmserve.metrics.tracing import get_tracer
from mmserve.model.assistant_spec import load_assistant_spec
from mmserve.model.spec import load_spec

# the last one is longer than a step's budget (256 tokens: the warm-up image's size): chunked prefill
PROMPTS = ["the cat sat on the mat and then the cat sat again on the other mat", "in the",
           " ".join(f"word{i} and the cat" for i in range(40))]


class DraftCounting(TelemetryObserver):
    """The real observer, also counting the draft rows the step records carry and keeping the records."""

    draft_rows = 0

    def on_step(self, record) -> None:
        self.draft_rows += sum(i.draft_rows for i in record.items)
        self.records.append(record)
        super().on_step(record)


@pytest.fixture(scope="module")
def served(tmp_path_factory, gemma4_fixtures):
    root = tmp_path_factory.mktemp("speculative_server")
    cfg = gemma4_fixtures.tiny_config(window=6)
    hf = gemma4_fixtures.make_checkpoint(root / "target", config=cfg, seed=41)
    gemma4_fixtures.make_assistant(root / "assistant", cfg, seed=43, copy_from=hf)
    config = engine_config(root / "target", speculative_model=str(root / "assistant"), num_speculative_tokens=3,
                           block_size=4, max_num_batched_tokens=256)
    metrics = EngineMetrics(prometheus=True)
    perf = PerfModel(load_spec(root / "target"), dtype="float32", drafter=load_assistant_spec(root / "assistant"))
    observer = DraftCounting(perf,
                                 DevicePeaks("test", flops=1e10, bandwidth=1e10, source="test"),
                                 tracer=get_tracer(), metrics=metrics, step_trace_ratio=0)
    observer.records = []
    server = LoopbackServer(config, ServerConfig(port=0, worker_threads=2, drain_grace_s=5.0),
                            observer=observer).start()
    http, port = start_metrics_server(0, metrics, addr="127.0.0.1")
    yield server, port
    http.shutdown()
    server.stop()
    metrics.shutdown()


def scrape(port: int) -> dict[str, float]:
    """Sample name with its labels -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def generate(client, **kwargs):
    return client.generate(temperature=0, ignore_eos=True, max_tokens=24, **kwargs)


def test_speculation_gives_the_tokens_of_plain_decoding(served, video_bytes):
    server, port = served
    with Client(server.address, timeout=120) as client:
        assert client.model_info().num_speculative_tokens == 3
        for prompt in PROMPTS:
            plain = generate(client, prompt=prompt, disable_speculation=True)
            fast = generate(client, prompt=prompt)
            assert fast.token_ids == plain.token_ids, prompt
            assert fast.usage.cached_tokens > 0, "the second request of a prompt reuses its cached prefix"
        plain = generate(client, prompt="what happens?", video=video_bytes, disable_speculation=True)
        assert generate(client, prompt="what happens?", video=video_bytes).token_ids == plain.token_ids
        # a stop string that falls inside a step's accepted tokens ends the output there
        base = generate(client, prompt=PROMPTS[0], disable_speculation=True)
        stop = base.text[len(base.text) // 2:][:2]
        plain = generate(client, prompt=PROMPTS[0], stop=[stop], disable_speculation=True)
        fast = generate(client, prompt=PROMPTS[0], stop=[stop])
        assert plain.finish_reason == "stop" and (fast.text, fast.finish_reason) == (plain.text, plain.finish_reason)
        # a speculating request cancelled mid-stream, beside one that runs on
        stream = client.stream(prompt=PROMPTS[2], temperature=0, ignore_eos=True, max_tokens=400)
        other = client.stream(prompt=PROMPTS[0], temperature=0.8, seed=3, ignore_eos=True, max_tokens=30)
        next(iter(stream))
        stream.cancel()
        for _ in other:
            pass
        assert len(other.result.token_ids) == 30
    # the drafting the perf model bills crossed from the engine process with the step records
    assert server.observer.draft_rows > 0
    deadline = time.monotonic() + 30
    while (held := server.call(server.engine.held_resources()))["requests"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not held["requests"] and not held["kv_blocks_held"] and not held["streams"], held
    # acceptance per draft position: drafts were both kept and rejected, never more kept than scored
    metrics = scrape(port)
    for position in range(3):
        drafts = metrics[f'mmserve_speculative_draft_tokens_total{{position="{position}"}}']
        kept = metrics.get(f'mmserve_speculative_accepted_tokens_total{{position="{position}"}}', 0.0)
        assert drafts > kept >= 0, (position, drafts, kept)
    assert metrics['mmserve_speculative_accepted_tokens_total{position="0"}'] > 0
    assert metrics["mmserve_speculative_verify_chunks_total"] >= metrics[
        'mmserve_speculative_draft_tokens_total{position="0"}']


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["ab", "cd"]}},
          "required": ["n", "tag"], "additionalProperties": False}


def draft_counters(port: int) -> tuple[float, float]:
    metrics = scrape(port)
    return (metrics.get('mmserve_speculative_draft_tokens_total{position="0"}', 0.0),
            metrics.get('mmserve_speculative_accepted_tokens_total{position="0"}', 0.0))


def test_json_schema_and_prompt_logprobs_requests_speculate(served):
    """A JSON-schema request's greedy tokens with speculation equal its tokens with
    `disable_speculation`, its text is valid JSON of the schema, and its drafts were verified and
    some accepted (the acceptance counters moved while only it ran; on the async loop, which drafts
    unmasked before the matcher sees the step's tokens, only verified); a seeded random one is valid
    JSON too. A prompt_logprobs request speculates to the same tokens and prompt logprobs."""
    import json

    server, port = served
    with Client(server.address, timeout=120) as client:
        for prompt in PROMPTS[:2]:
            plain = client.generate(prompt=prompt, temperature=0, max_tokens=40, json_schema=SCHEMA,
                                    disable_speculation=True)
            before = draft_counters(port)
            fast = client.generate(prompt=prompt, temperature=0, max_tokens=40, json_schema=SCHEMA)
            assert fast.token_ids == plain.token_ids, prompt
            assert fast.finish_reason == "eos" and set(json.loads(fast.text)) == {"n", "tag"}, fast.text
            deadline = time.monotonic() + 30   # the step records reach the metrics just after the reply
            while (after := draft_counters(port)) == before and time.monotonic() < deadline:
                time.sleep(0.05)
            assert after[0] > before[0] and (after[1] > before[1] or server.async_loop), (before, after)
        drawn = client.generate(prompt=PROMPTS[0], temperature=1.0, seed=11, max_tokens=40, json_schema=SCHEMA)
        assert drawn.finish_reason == "eos" and json.loads(drawn.text)["tag"] in ("ab", "cd"), drawn.text
        plain = generate(client, prompt=PROMPTS[2], prompt_logprobs=True, disable_speculation=True)
        before = draft_counters(port)
        fast = generate(client, prompt=PROMPTS[2], prompt_logprobs=True)
        assert fast.token_ids == plain.token_ids
        assert len(fast.prompt_logprobs) == len(plain.prompt_logprobs) > 50
        for a, b in zip(fast.prompt_logprobs, plain.prompt_logprobs, strict=True):
            assert (a.token_id, a.rank) == (b.token_id, b.rank) and abs(a.logprob - b.logprob) < 1e-4
        deadline = time.monotonic() + 30
        while draft_counters(port) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert draft_counters(port)[0] > before[0]


def test_perf_cli_bills_a_speculating_request_as_the_server_did(served):
    """`mmserve perf --speculative-model` over each step one speculating request took alone through
    the server (its chunk from the step record; its drafting: draft rows as K, draft keys as the 4th
    field) adds up to the FLOPs and bytes the server billed it (its Final perf: target rows, verify
    rows and drafter)."""
    import contextlib
    import io
    import json

    from mmserve.cli import main

    server, _ = served
    target, assistant = server.engine_config.model, server.engine_config.speculative_model
    server.observer.records.clear()
    with Client(server.address, timeout=120) as client:
        result = generate(client, prompt=PROMPTS[0])
    steps = [i for r in server.observer.records for i in r.items if i.request_id == result.request_id]
    assert all(len(r.items) == 1 for r in server.observer.records) and any(i.draft_tokens for i in steps)
    total = {"flops": 0.0, "read_bytes": 0.0, "write_bytes": 0.0}
    for item in steps:
        request = f"{item.num_tokens}:{item.context_len}:{'prefill' if item.is_prefill else 'decode'}"
        args = ["perf", "--hf-config", target, "--dtype", "float32", "--json", "--request", request]
        if item.draft_rows:
            args[-1] += f":{item.draft_keys}"
            args += ["--speculative-model", assistant, "--num-speculative-tokens", str(item.draft_rows)]
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert main(args) == 0
        billed = json.loads(out.getvalue())
        assert any(k.startswith("drafter.") for k in billed["flops"]) == bool(item.draft_rows)
        for kind in total:
            total[kind] += sum(billed[kind].values())
    assert result.perf.flops > 0
    for kind, value in total.items():
        assert value == pytest.approx(getattr(result.perf, kind), rel=1e-9), kind
